"""Firing the cluster faults of ``keel up --inject`` (``lose_node``, ``kill_leader``,
``restart_etcd``, ``kill_agent``, the stalls and ``partition_node``) once rank 0
reports their step. Each firing is a ``Fired`` record: what was done, to what, at which
step. A stall or a partition is undone by a timer ``for_s`` after it fired, and, at
the latest, by ``release`` when the cluster stops: no process is left stopped."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from dataclasses import dataclass, field

from google.protobuf import json_format

from common import env, procs
from common.keys import local_node
from common.wire_kinds import FaultKind
from orchestrator.local.cluster import LocalCluster
from orchestrator.local.faults import CLUSTER_FAULTS, kind_of
from protos import keel_pb2

ETCD_DOWN_S = 2.0  # restart_etcd: how long etcd stays down unless its down= says


@dataclass(frozen=True)
class Fired:
    """A fault fired: ``kind``, at ``step``, described by ``message``."""

    kind: FaultKind
    step: int
    message: str


@dataclass
class ClusterFaults:
    """The schedule's faults that `keel up` fires itself: ``lose_node`` kills an agent's
    process group (its ranks die with it through their parent-death signal),
    ``kill_leader`` SIGKILLs the leading controller, ``restart_etcd`` crashes etcd and
    starts it again on its data after its ``down_s`` (``ETCD_DOWN_S`` by default), and
    ``kill_agent`` SIGKILLs an agent and starts it again."""

    pending: list[keel_pb2.Fault]
    lost: set[int] = field(default_factory=set)  # agent indexes
    killed_controllers: set[int] = field(default_factory=set)
    undo: list[threading.Timer] = field(default_factory=list)  # stalls, partitions
    stopped: set[int] = field(default_factory=set)  # pids SIGSTOPped now
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, spec: keel_pb2.JobSpec) -> ClusterFaults:
        if env.FAULTS not in spec.env:
            return cls([])
        schedule = json_format.Parse(spec.env[env.FAULTS], keel_pb2.FaultSchedule())
        return cls([f for f in schedule.faults if kind_of(f) in CLUSTER_FAULTS])

    def fire(self, step: int, cluster: LocalCluster, leader: str | None) -> list[Fired]:
        """Fire every pending fault due at ``step`` (``FIRING``: what each kind does);
        ``leader``: the leading controller's address, if one leads (a fault of the
        leader waits for one)."""
        fired = []
        for fault in [f for f in self.pending if step >= f.step]:
            kind = kind_of(fault)
            if kind in OF_THE_LEADER:
                if leader not in cluster.addresses:
                    continue  # no leader right now: fire once one leads
                message = self._of_the_leader(kind, fault, step, cluster, leader)
            else:
                message = FIRING[kind](self, fault, step, cluster)
            self.pending.remove(fault)
            fired.append(Fired(kind, step, message))
        return fired

    def _lose_node(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        agent = cluster.agents[fault.node]
        os.killpg(agent.pid, signal.SIGKILL)
        self.lost.add(fault.node)
        # Its memory goes with it, as a node's does: on one machine the tmpfs would
        # outlive it, and another node's agent could not have read it anyway.
        shutil.rmtree(cluster.memory_root / local_node(fault.node), ignore_errors=True)
        return (
            f"injected: node-{fault.node} lost (agent pid {agent.pid}, its ranks and "
            f"its memory) at step {step}"
        )

    def _kill_agent(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        agent = cluster.agents[fault.node]
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        cluster.agents[fault.node] = cluster.start_agent(fault.node)
        return (
            f"injected: node-{fault.node}'s agent (pid {agent.pid}) killed at "
            f"step {step} and started again (pid "
            f"{cluster.agents[fault.node].pid})"
        )

    def _term_agent(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        agent = cluster.agents[fault.node]
        agent.send_signal(signal.SIGTERM)
        self.lost.add(fault.node)  # it exits once its node is drained
        return (
            f"injected: node-{fault.node}'s agent (pid {agent.pid}) sent "
            f"SIGTERM at step {step}: its node drains"
        )

    def _restart_etcd(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        down_s = fault.down_s or ETCD_DOWN_S
        cluster.etcd.restart(down_s=down_s)
        return f"injected: etcd killed at step {step}, back after {down_s:g} s on its data"

    def _stall_agent(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        agent = cluster.agents[fault.node]
        self._stall([agent.pid], fault.for_s)
        return (
            f"injected: node-{fault.node}'s agent (pid {agent.pid}) stopped at "
            f"step {step} for {fault.for_s:g} s; its ranks run on"
        )

    def _stall_node(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        agent = cluster.agents[fault.node]
        stalled = [agent.pid, *procs.descendants(agent.pid)]
        self._stall(stalled, fault.for_s)
        return (
            f"injected: node-{fault.node} frozen at step {step} for "
            f"{fault.for_s:g} s (agent pid {agent.pid} and {len(stalled) - 1} "
            f"processes under it stopped)"
        )

    def _partition_node(self, fault: keel_pb2.Fault, step: int, cluster: LocalCluster) -> str:
        cluster.proxies[fault.node].cut()
        self._later(fault.for_s, cluster.proxies[fault.node].heal)
        return (
            f"injected: node-{fault.node} cut from etcd and the controllers at "
            f"step {step} for {fault.for_s:g} s; it runs on"
        )

    def _of_the_leader(
        self, kind: FaultKind, fault: keel_pb2.Fault, step: int, cluster: LocalCluster, leader: str
    ) -> str:
        """kill_leader, term_leader and stall_leader, of the controller that leads."""
        index = cluster.addresses.index(leader)
        if kind is FaultKind.KILL_LEADER:
            os.killpg(cluster.controllers[index].pid, signal.SIGKILL)
            self.killed_controllers.add(index)
            return f"injected: leader controller {leader} killed at step {step}"
        if kind is FaultKind.TERM_LEADER:
            cluster.controllers[index].send_signal(signal.SIGTERM)
            self.killed_controllers.add(index)
            return (
                f"injected: leader controller {leader} sent SIGTERM at step "
                f"{step}: it hands the lead over"
            )
        self._stall([cluster.controllers[index].pid], fault.for_s)
        return f"injected: leader controller {leader} stopped at step {step} for {fault.for_s:g} s"

    def _stall(self, pids: list[int], for_s: float) -> None:
        with self.lock:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped.add(pid)
                except ProcessLookupError:
                    pass
        self._later(for_s, lambda: self._resume(pids))

    def _resume(self, pids: list[int]) -> None:
        with self.lock:
            for pid in pids:
                if pid in self.stopped:
                    self.stopped.discard(pid)
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass

    def _later(self, delay_s: float, action) -> None:
        timer = threading.Timer(delay_s, action)
        timer.daemon = True
        timer.start()
        self.undo.append(timer)

    def release(self, cluster: LocalCluster) -> None:
        """Undo every stall and partition still in force (the cluster is stopping)."""
        for timer in self.undo:
            timer.cancel()
        self._resume(list(self.stopped))
        for proxy in cluster.proxies:
            proxy.heal()


# What each cluster fault does to a node, etcd or the leader (``ClusterFaults.fire``).
OF_THE_LEADER = frozenset({FaultKind.KILL_LEADER, FaultKind.TERM_LEADER, FaultKind.STALL_LEADER})
FIRING = {
    FaultKind.LOSE_NODE: ClusterFaults._lose_node,
    FaultKind.KILL_AGENT: ClusterFaults._kill_agent,
    FaultKind.TERM_AGENT: ClusterFaults._term_agent,
    FaultKind.RESTART_ETCD: ClusterFaults._restart_etcd,
    FaultKind.STALL_AGENT: ClusterFaults._stall_agent,
    FaultKind.STALL_NODE: ClusterFaults._stall_node,
    FaultKind.PARTITION_NODE: ClusterFaults._partition_node,
}
