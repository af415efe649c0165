"""Firing the cluster faults of ``keel up --inject`` (``lose_node``, ``kill_leader``,
``restart_etcd``, ``kill_agent``) once rank 0 reports their step. Each firing is a
``Fired`` record: what was done, to what, at which step."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from google.protobuf import json_format

from common import env
from orchestrator.local.cluster import LocalCluster
from orchestrator.local.faults import CLUSTER_FAULTS
from protos import keel_pb2

ETCD_DOWN_S = 2.0    # restart_etcd: how long etcd stays down unless its down= says


@dataclass(frozen=True)
class Fired:
    """A fault fired: ``kind`` (a ``Fault.kind``), at ``step``, described by ``message``."""
    kind: str
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
    lost: set[int] = field(default_factory=set)              # agent indexes
    killed_controllers: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, spec: keel_pb2.JobSpec) -> ClusterFaults:
        if env.FAULTS not in spec.env:
            return cls([])
        schedule = json_format.Parse(spec.env[env.FAULTS], keel_pb2.FaultSchedule())
        return cls([f for f in schedule.faults if f.kind in CLUSTER_FAULTS])

    def fire(self, step: int, cluster: LocalCluster, leader: str | None) -> list[Fired]:
        """Fire every pending fault due at ``step``; ``leader``: the leading controller's
        address, if one leads (a ``kill_leader`` waits for one)."""
        fired = []
        for fault in [f for f in self.pending if step >= f.step]:
            if fault.kind == "lose_node":
                agent = cluster.agents[fault.node]
                os.killpg(agent.pid, signal.SIGKILL)
                self.lost.add(fault.node)
                message = (f"injected: node-{fault.node} lost (agent pid {agent.pid} and its "
                           f"ranks killed) at step {step}")
            elif fault.kind == "kill_agent":
                agent = cluster.agents[fault.node]
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
                cluster.agents[fault.node] = cluster.start_agent(fault.node)
                message = (f"injected: node-{fault.node}'s agent (pid {agent.pid}) killed at "
                           f"step {step} and started again (pid "
                           f"{cluster.agents[fault.node].pid})")
            elif fault.kind == "restart_etcd":
                down_s = fault.down_s or ETCD_DOWN_S
                cluster.etcd.restart(down_s=down_s)
                message = f"injected: etcd killed at step {step}, back after {down_s:g} s on its data"
            elif leader in cluster.addresses:
                index = cluster.addresses.index(leader)
                os.killpg(cluster.controllers[index].pid, signal.SIGKILL)
                self.killed_controllers.add(index)
                message = f"injected: leader controller {leader} killed at step {step}"
            else:
                continue  # no leader right now: fire once one leads
            self.pending.remove(fault)
            fired.append(Fired(fault.kind, step, message))
        return fired
