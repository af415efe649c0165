"""A restarted agent cleans up after its predecessor, and never after a live agent."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from agent.leftovers import RunDirInUse, carrying, started_at, take_over
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
            "pid": os.getpid(), "started": started_at(os.getpid()), "socket": "/new/agent.sock"}
    finally:
        for proc in (left, other):
            proc.kill()
            proc.wait()


def test_a_run_dir_owned_by_a_live_agent_is_refused_and_a_reused_pid_is_not(tmp_path):
    live = subprocess.Popen(["sleep", "60"])
    try:
        record = {"pid": live.pid, "started": started_at(live.pid), "socket": "/s"}
        (tmp_path / "agent.json").write_text(json.dumps(record))
        with pytest.raises(RunDirInUse, match=f"agent pid {live.pid} is running"):
            take_over(tmp_path, "/new/agent.sock")
        assert json.loads((tmp_path / "agent.json").read_text()) == record
        # The same pid with another start time is another process (the pid was reused).
        (tmp_path / "agent.json").write_text(json.dumps({**record, "started": 1}))
        assert take_over(tmp_path, "/new/agent.sock") == 0
        assert json.loads((tmp_path / "agent.json").read_text())["pid"] == os.getpid()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("text", ["[]", '{"pid": "12"}', '{"socket": "/s"}', "not json"])
def test_a_malformed_record_is_treated_as_no_previous_agent(tmp_path, text):
    (tmp_path / "agent.json").write_text(text)
    assert take_over(tmp_path, "/new/agent.sock") == 0
    assert json.loads((tmp_path / "agent.json").read_text())["socket"] == "/new/agent.sock"
