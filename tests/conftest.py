"""Shared fixtures: a real etcd on free ports, and a guard against leaked processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent.local_server import AgentLocalService, serve
from orchestrator.etcd_server import EmbeddedEtcd

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def etcd():
    with EmbeddedEtcd() as server:
        yield server


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until truthy; return its value or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def processes_mentioning(text: str) -> list[int]:
    """PIDs (other than ours) whose command line or environment contains ``text``."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or \
                    needle in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


@pytest.fixture
def no_leaks(tmp_path):
    """Fails the test if any process that mentions ``tmp_path`` outlives it."""
    yield tmp_path
    leaked = processes_mentioning(str(tmp_path))
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"processes outlived the test: {leaked}"


def keel(*args: str, timeout_s: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the keel CLI as a user would, capturing its output."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@contextlib.contextmanager
def local_agent(recorder):
    """The agent's real AgentLocal service on a Unix socket, calling ``recorder``'s
    ``on_steps``, ``on_checkpoint`` and (if it has one) ``on_preflight``; yields the
    socket path for KEEL_AGENT_SOCKET."""
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    directory = tempfile.mkdtemp(prefix="keel-agent-")
    socket_path = os.path.join(directory, "agent.sock")
    server = serve(socket_path, AgentLocalService(
        recorder.on_steps, recorder.on_checkpoint,
        getattr(recorder, "on_preflight", lambda _report: None)))
    try:
        yield socket_path
    finally:
        server.stop(grace=None)
        shutil.rmtree(directory, ignore_errors=True)
