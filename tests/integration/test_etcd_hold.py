"""The hold a controller puts on self-fencing while etcd is out of its reach runs out
once that controller is gone (a real three-member etcd, every member stalled; real
controller, agent and rank processes)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from orchestrator.local.etcd_server import EmbeddedEtcd, memory_backed_dir
from tests.conftest import keel, wait_for

SLEEPER = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.fixture
def etcd():
    with EmbeddedEtcd(data_parent=memory_backed_dir(), members=3) as server:
        yield server


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        return " (Z" not in Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False


def test_a_hold_from_a_controller_that_is_gone_runs_out_and_the_node_fences_itself(cluster, etcd):
    """etcd stalls: the leader tells the agent the outage is everyone's, and the agent
    keeps its rank past its lease. Then the leader dies, etcd still stalled: nobody
    renews the hold, and the agent stops its rank once it runs out, rather than keep a
    rank that a leader elsewhere may already have replaced."""
    cluster.controller()
    cluster.agent("node-a", slots="1")
    wait_for(lambda: cluster.store.nodes().get("node-a"), 30, what="node-a registered")
    script, pid_file = cluster.path / "sleeper.py", cluster.path / "rank.pid"
    script.write_text(SLEEPER)
    spec = cluster.path / "held.toml"
    spec.write_text(
        f'name = "held"\nworld_size = 1\nmax_restarts = 0\n'
        f'command = ["{sys.executable}", "{script}", "{pid_file}"]\n'
        f"[health]\npreflight_off = true\n"
    )
    common = [
        "--etcd-endpoints",
        ",".join(etcd.endpoints),
        "--token-file",
        str(cluster.path / "token"),
    ]
    submitted = keel("submit", str(spec), *common)
    assert submitted.returncode == 0, submitted.stderr
    wait_for(pid_file.exists, 60, 0.2, what="the rank running")
    rank = int(pid_file.read_text())
    agent_log = cluster.path / "node-a.log"
    for member in range(len(etcd.members)):
        etcd.stall(member)
    try:
        wait_for(
            lambda: "the controller cannot reach etcd either" in agent_log.read_text(),
            60,
            0.2,
            what="the leader's hold on the agent",
        )
        # Held: a lease TTL (2 s) and more pass without renewal, the rank runs on.
        wait_for(lambda: "lease refresh failed" in agent_log.read_text(), 30, 0.2, what="a lapse")
        assert alive(rank) and "stopping the ranks" not in agent_log.read_text()
        cluster.controllers[0].kill()
        cluster.controllers[0].wait()
        wait_for(
            lambda: "stopping the ranks" in agent_log.read_text(),
            60,
            0.2,
            what="the agent to fence itself once the hold ran out",
        )
        wait_for(lambda: not alive(rank), 30, 0.2, what="the rank stopped")
        stopping = next(
            line for line in agent_log.read_text().splitlines() if "stopping the ranks" in line
        )
        assert "the controller's hold on it ran out" in stopping, stopping
    finally:
        for member in range(len(etcd.members)):
            etcd.resume(member)
        if alive(rank):
            os.kill(rank, signal.SIGKILL)
