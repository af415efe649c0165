"""The controller's cost grows with what changes, not with the cluster (issue 14): an
agent stream holds no thread, a tick reads no node records from etcd and squares with
the plan only the nodes that said something new, and a connect storm past the
admission queue is deferred, not let in to time out. Agents here are
``benchmarks/simulated_agents.py``: real gRPC streams, each on its own connection,
each with its own etcd lease, many in one process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from common import keys
from common.tls import call_metadata
from orchestrator.controller import reconcile, sessions
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.daemon import Controller
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import REPO, wait_for
from tests.integration.conftest import spawn
from tests.integration.test_gray_failures import log_lines

TOKEN = "t"
AGENTS = 150


class SimulatedAgents:
    """``benchmarks.simulated_agents`` in a process of its own; ``connected()``: how
    many are connected, as it last said."""

    def __init__(self, etcd: str, controller: str, count: int):
        self.count = 0
        self.paced: dict[str, int] = {}  # report interval asked -> agents connected
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.simulated_agents",
                "--etcd",
                etcd,
                "--controllers",
                controller,
                "--token",
                TOKEN,
                "--agents",
                str(count),
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            self.count = sum(message.get("by", {}).values())
            self.paced = message.get("paced", {})

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def key(args) -> str:
    """The key an etcd client call was given first."""
    first = args[0] if args else ""
    return first.decode() if isinstance(first, bytes) else str(first)


def count_calls(obj, names: list[str], calls: list, record=lambda name, args: name) -> None:
    """Wrap ``obj``'s methods ``names`` so that each call appends ``record(name, args)``
    to ``calls``."""

    def counting(real, name):
        def counted(*args, **kwargs):
            calls.append(record(name, args))
            return real(*args, **kwargs)

        return counted

    for name in names:
        setattr(obj, name, counting(getattr(obj, name), name))


def test_agent_streams_hold_no_thread_and_a_tick_looks_only_at_what_changed(etcd, monkeypatch):
    controller = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token=TOKEN))
    address = controller.serve()
    state = controller.state
    agents = None
    try:
        wait_for(lambda: state.is_leader, 30, what="the controller to lead")
        threads_before = threading.active_count()
        agents = SimulatedAgents(etcd.endpoint, address, AGENTS)
        wait_for(
            lambda: state.connected() == AGENTS and agents.count == AGENTS,
            120,
            what=f"{AGENTS} agents connected",
        )
        wait_for(
            lambda: len(state.registered) == AGENTS, 30, what="the watch to bring every node record"
        )
        # A stream holds no thread of its own (a thread or two each would be hundreds
        # more here).
        grown = threading.active_count() - threads_before
        assert grown < 20, f"{grown} threads more for {AGENTS} agent streams"
        # Settled (every Hello squared with the plan, the first sweep done): from now
        # on, ticks look at no node, and read no node record from etcd. Each agent
        # still sends its status every second; it says nothing new.
        wait_for(lambda: not state.unsettled, 30, what="every node settled")
        monkeypatch.setattr(reconcile, "SWEEP_S", 3600.0)
        controller.reconciler.next_sweep = time.monotonic() + 3600.0
        converged, reads = [], []
        monkeypatch.setattr(
            reconcile.convergence,
            "converge",
            lambda *args, _real=(reconcile.convergence.converge): (
                converged.append(args[1].node) or _real(*args)
            ),
        )
        count_calls(
            state.store.client,
            ["get", "get_response", "get_range_response", "get_prefix"],
            reads,
            lambda name, args: (name, key(args)),
        )

        def ticks() -> float:
            return next(
                s.value
                for s in reconcile.metrics.RECONCILE_TICK.collect()[0].samples
                if s.name.endswith("_count")
            )

        before = ticks()
        wait_for(lambda: ticks() >= before + 10, 30, what="ten ticks")
        assert converged == [], f"ten ticks squared {len(converged)} nodes with the plan"
        assert reads, "the ticks' probe of etcd was not counted"
        node_reads = [r for r in reads if r[1].startswith(keys.NODES)]
        assert node_reads == [], f"ticks read node records: {node_reads[:3]}"
        # A node whose record goes (its lease revoked) is known gone from the watch,
        # and squared with the plan again at the next tick.
        node = sorted(state.registered)[0]
        state.store.client.revoke_lease(state.registered[node].lease_id)
        wait_for(lambda: node not in state.registered, 10, what="the watch to drop the record")
        wait_for(lambda: node in converged, 10, what="the node looked at again")
    finally:
        if agents is not None:
            agents.stop()
        controller.shutdown()


def test_a_connect_storm_past_the_admission_queue_is_deferred_and_then_admitted(etcd, monkeypatch):
    """Hellos wait for etcd on a few threads; past the queue, a Connect is refused at
    once (RESOURCE_EXHAUSTED, back off) instead of waiting to time out. The hold-up is
    deterministic: the lease check blocks until released."""
    monkeypatch.setattr(sessions, "ADMISSION_QUEUE", 2)
    controller = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token=TOKEN))
    address = controller.serve()
    state = controller.state
    release, checking = threading.Event(), []
    real_alive = state.store.lease_alive

    def held(lease_id):
        checking.append(lease_id)
        release.wait(30)
        return real_alive(lease_id)

    state.store.lease_alive = held
    channels, streams, done = [], [], threading.Event()
    try:
        wait_for(lambda: state.is_leader, 30, what="the controller to lead")

        def connect(node: str):
            lease = state.store.client.lease(30)
            channel = grpc.insecure_channel(
                address, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            channels.append(channel)
            hello = keel_pb2.AgentMessage(
                hello=keel_pb2.Hello(
                    node=node,
                    host="127.0.0.1",
                    slots=1,
                    lease_id=lease.id,
                    heartbeat_s=0.5,
                    reconnect_max_s=5,
                    lease_ttl_s=5,
                )
            )

            def messages():
                yield hello
                done.wait(60)  # the stream stays open until the test ends

            call = keel_pb2_grpc.ControllerStub(channel).Connect(
                messages(), metadata=call_metadata(TOKEN), timeout=60
            )
            streams.append(call)
            return call

        first, second = connect("node-a"), connect("node-b")
        wait_for(
            lambda: len(checking) >= 1 and controller.agents.waiting == 2,
            30,
            what="two Hellos in the admission queue",
        )
        third = connect("node-c")
        with pytest.raises(grpc.RpcError) as refused:
            next(third)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "back off" in refused.value.details()
        release.set()
        for call in (first, second):
            assert next(call).WhichOneof("kind") == "welcome"
        wait_for(lambda: state.connected() == 2, 10, what="both admitted")
        assert sorted(state.sessions) == ["node-a", "node-b"]
        assert controller.agents.refused == 1
    finally:
        release.set()
        done.set()
        for call in streams:
            call.cancel()
        for channel in channels:
            channel.close()
        controller.shutdown()


def test_a_large_cluster_is_asked_to_batch_its_step_reports_for_longer(etcd, tmp_path):
    """Each step message costs the controller the same whatever it carries: past
    ``report_messages_per_s / 2`` agents, each is asked to batch for longer. At 50 a
    second, 150 agents are asked for 4 s: as they connect, the interval grows 0, 1, 2,
    4 s, told to those already connected (ReportPace) and to each new one (its
    Welcome). A real agent that joins then is told 4 s in its Welcome, and its own pace
    again (0) once the others have left."""
    controller = Controller(
        ControllerConfig(etcd_endpoints=(etcd.endpoint,), token=TOKEN, report_messages_per_s=50.0)
    )
    address = controller.serve()
    state = controller.state
    agents = agent = None
    (tmp_path / "token").write_text(TOKEN)
    log = tmp_path / "agent.log"

    def said(event: str) -> list[dict]:
        return [e for e in log_lines(log) if e["event"] == event] if log.exists() else []

    try:
        wait_for(lambda: state.is_leader, 30, what="the controller to lead")
        agents = SimulatedAgents(etcd.endpoint, address, AGENTS)
        wait_for(
            lambda: agents.paced == {"4": AGENTS},
            120,
            what=f"{AGENTS} agents connected, each asked for 4 s batches",
        )
        assert state.report_interval_s == 4.0
        agent = spawn(
            [
                "-m",
                "agent",
                "--node",
                "real",
                "--slots",
                "1",
                "--etcd-endpoints",
                etcd.endpoint,
                "--token-file",
                str(tmp_path / "token"),
                "--run-dir",
                str(tmp_path / "real"),
                "--log-format",
                "json",
            ],
            log,
        )
        wait_for(lambda: said("connected to controller"), 60, what="the real agent connected")
        assert said("connected to controller")[-1]["report_interval_s"] == 4.0
        agents.stop()
        agents = None
        wait_for(
            lambda: said("batching step reports as the controller asks"),
            60,
            what="the real agent told its own pace again",
        )
        assert said("batching step reports as the controller asks")[-1]["report_interval_s"] == 0.0
        assert state.report_interval_s == 0.0
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGINT)
            agent.wait(30)
        if agents is not None:
            agents.stop()
        controller.shutdown()
