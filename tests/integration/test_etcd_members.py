"""One etcd member of three out of the game costs nothing: real etcd members (each its
own process), two real controllers, real agents and rank processes.

The member that the leading controller talks to is stalled (SIGSTOP) for 120 s, then
has its clients' traffic dropped for 60 s, then is killed: through all of it a majority
of etcd serves, and the leader must keep its lead, every node its lease, and the job its
generation. Traffic is dropped by a loopback proxy in front of each member that goes
silent (``EmbeddedEtcd(proxied=True)``): this machine has neither iptables nor netem,
and a proxy that forwards nothing, closing nothing, is what a client sees of dropped
packets.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from common.etcd import connect
from orchestrator.controller.store import Store
from orchestrator.local.etcd_server import EmbeddedEtcd, memory_backed_dir
from protos import keel_pb2
from tests.conftest import keel, wait_for

STALL_S = 120.0  # the figure
DROP_S = 60.0
KILL_S = 20.0

SLEEPER = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(3600)
"""


@pytest.fixture
def etcd():
    """Three members, each behind a proxy that can drop its clients' traffic."""
    with EmbeddedEtcd(data_parent=memory_backed_dir(), members=3, proxied=True) as server:
        yield server


def member_talked_to(etcd: EmbeddedEtcd, pid: int) -> int:
    """The member process ``pid`` has the most connections open to (via its proxy)."""
    listing = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    counts = [0] * len(etcd.members)
    for line in listing.splitlines():
        if f"pid={pid}," not in line:
            continue
        peer = line.split()[-2] if "users:" in line.split()[-1] else line.split()[-1]
        member = etcd.member_of_port(int(peer.rpartition(":")[2]))
        if member is not None:
            counts[member] += 1
    assert max(counts) > 0, f"pid {pid} has no connection to any etcd member"
    return counts.index(max(counts))


class Watchman:
    """Samples, every half second while a fault lasts, who leads and which nodes are
    registered, through the members that are not faulted, and keeps what changed."""

    def __init__(self, etcd: EmbeddedEtcd, spared: list[int], nodes: set[str]):
        self.store = Store(connect([etcd.endpoints[i] for i in spared], 2.0))
        self.nodes = nodes
        self.seen: list[str] = []  # what went wrong, when it did
        self.leader = self.store.leader()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                leader, nodes = self.store.leader(), set(self.store.nodes())
            except Exception:
                continue  # the spared members electing a raft leader: asked again
            self.samples += 1
            if leader != self.leader:
                self.seen.append(f"the leader changed: {self.leader} -> {leader}")
            if not self.nodes <= nodes:
                self.seen.append(f"nodes unregistered: {sorted(self.nodes - nodes)}")

    def __enter__(self) -> Watchman:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_a_stalled_black_holed_or_killed_member_of_three_costs_no_lead_node_or_restart(
    cluster, etcd
):
    leader_address = cluster.controller()
    cluster.controller(name="standby", lead=False)
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="1")
    nodes = {"node-a", "node-b"}
    wait_for(lambda: nodes <= set(cluster.store.nodes()), 30, what="both agents registered")
    script, pids = cluster.path / "sleeper.py", cluster.path / "pids"
    script.write_text(SLEEPER)
    pids.mkdir()
    spec = cluster.path / "steady.toml"
    spec.write_text(
        f'name = "steady"\nworld_size = 2\n'
        f'command = ["{sys.executable}", "{script}", "{pids}"]\n'
        f"[health]\npreflight_off = true\n"
    )
    common = ["--etcd-endpoints", ",".join(etcd.endpoints)]
    submitted = keel("submit", str(spec), *common, "--token-file", str(cluster.path / "token"))
    assert submitted.returncode == 0, submitted.stderr
    wait_for(lambda: len(list(pids.iterdir())) == 2, 60, 0.2, what="both ranks running")
    ranks = {p.name: int(p.read_text()) for p in pids.iterdir()}
    leader_pid = cluster.controllers[0].pid
    assert cluster.store.controller_address() == leader_address

    def fault(name, length_s, strike, heal):
        member = member_talked_to(etcd, leader_pid)
        spared = [i for i in range(len(etcd.members)) if i != member]
        with Watchman(etcd, spared, nodes) as watchman:
            strike(member)
            try:
                time.sleep(length_s)  # the fault's length: what is tested is riding it out
            finally:
                heal(member)
        assert watchman.samples > length_s, f"{name}: too few samples ({watchman.samples})"
        assert not watchman.seen, f"{name} of member {member}: {watchman.seen[:5]}"
        return member

    fault("SIGSTOP", STALL_S, etcd.stall, etcd.resume)
    fault("dropped traffic", DROP_S, etcd.drop_traffic, etcd.restore_traffic)
    fault("SIGKILL", KILL_S, etcd.kill, etcd.revive)

    # The job never noticed: its first generation runs on, the same processes.
    state = cluster.store.job_state("steady").value
    assert (state.state, state.generation, state.restarts) == ("RUNNING", 1, 0), state
    assert {p.name: int(p.read_text()) for p in pids.iterdir()} == ranks
    for pid in ranks.values():
        assert re.search(r"\) [RS] ", open(f"/proc/{pid}/stat").read()), pid
    lost = [
        r.event.reason
        for r in cluster.store.events("steady")
        if r.event.kind == keel_pb2.EVENT_KIND_NODE_LOST
    ]
    assert not lost, lost
    for node in nodes:
        log = (cluster.path / f"{node}.log").read_text()
        assert "stopping the ranks" not in log
    assert cluster.store.controller_address() == leader_address
