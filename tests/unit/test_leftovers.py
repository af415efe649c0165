"""A restarted agent cleans up after its predecessor, and never after a live agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from agent.leftovers import RunDirInUse, carrying, take_over
from tests.conftest import wait_for


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_processes_left_by_the_previous_agent_are_killed_and_ours_recorded(tmp_path):
    socket = str(tmp_path / "old" / "agent.sock")
    env = {**os.environ, "KEEL_AGENT_SOCKET": socket}
    left = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], env={**env, "KEEL_AGENT_SOCKET": socket + "x"})
    try:
        (tmp_path / "agent.json").write_text(json.dumps({"pid": _dead_pid(), "socket": socket}))
        # (Until it has exec'd, the child still carries our environment.)
        wait_for(lambda: carrying(f"KEEL_AGENT_SOCKET={socket}") == [left.pid], 10,
                 what="the leftover to carry its marker")
        assert take_over(tmp_path, "/new/agent.sock") == 1
        assert left.wait(5) == -9
        assert other.poll() is None, "a process of another agent was killed"
        assert json.loads((tmp_path / "agent.json").read_text()) == {
            "pid": os.getpid(), "socket": "/new/agent.sock"}
    finally:
        for proc in (left, other):
            proc.kill()
            proc.wait()


def test_a_run_dir_owned_by_a_live_agent_is_refused(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "agent"])
    try:
        # Until it has exec'd, the child still shows our command line.
        wait_for(lambda: b"agent" in Path(f"/proc/{live.pid}/cmdline").read_bytes(), 10,
                 what="the stand-in agent to start")
        (tmp_path / "agent.json").write_text(json.dumps({"pid": live.pid, "socket": "/s"}))
        with pytest.raises(RunDirInUse, match=f"agent pid {live.pid} is running"):
            take_over(tmp_path, "/new/agent.sock")
        assert json.loads((tmp_path / "agent.json").read_text())["pid"] == live.pid
    finally:
        live.kill()
        live.wait()
