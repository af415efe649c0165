"""Real etcd, a real controller process and real agent processes."""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
import urllib.request

import grpc
import pytest

from common.tls import call_metadata
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import wait_for
from tests.integration.conftest import TOKEN, stop


def test_agents_register_and_a_killed_agents_record_expires_with_its_lease(cluster):
    cluster.controller()
    a, b = cluster.agent("node-a"), cluster.agent("node-b")
    nodes = wait_for(
        lambda: (n := cluster.store.nodes()) and len(n) == 2 and n, 30, what="both nodes registered"
    )
    assert nodes["node-a"].slots == 2 and nodes["node-a"].host == "127.0.0.1"
    assert cluster.store.lease_alive(nodes["node-a"].lease_id)

    a.send_signal(signal.SIGKILL)
    a.wait()
    # The record lives on the agent's 2 s lease; nothing deletes it but the expiry.
    wait_for(lambda: "node-a" not in cluster.store.nodes(), 10, what="node-a to expire")
    assert "node-b" in cluster.store.nodes()

    # A clean stop revokes the lease: the record goes at once, not after the TTL.
    stop(b)
    assert b.returncode == 0
    assert "node-b" not in cluster.store.nodes()


def test_wrong_token_and_bad_requests_are_refused_and_change_nothing(cluster):
    address = cluster.controller()
    (cluster.path / "wrong").write_text("not-the-token")
    intruder = cluster.agent("intruder", token_file="wrong")
    wait_for(
        lambda: b"UNAUTHENTICATED" in (cluster.path / "intruder.log").read_bytes(),
        30,
        what="the agent to be refused",
    )
    assert "intruder" not in cluster.store.nodes()
    assert intruder.poll() is None, "a refused agent keeps retrying; it does not crash"

    before = list(cluster.store.client.get_prefix("/keel/jobs/"))
    with grpc.insecure_channel(address) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        spec = keel_pb2.JobSpec(name="ok-name", world_size=1, command=["true"])
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(
                keel_pb2.SubmitJobRequest(spec=spec), metadata=call_metadata("wrong"), timeout=5
            )
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetJob(keel_pb2.GetJobRequest(job="x"), timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "missing token" in err.value.details()

        bad = keel_pb2.JobSpec(name="Bad Name", world_size=0, command=[])
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(
                keel_pb2.SubmitJobRequest(spec=bad), metadata=call_metadata(TOKEN), timeout=5
            )
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "world_size: must be at least 1" in err.value.details()
        assert list(cluster.store.client.get_prefix("/keel/jobs/")) == before

        with pytest.raises(grpc.RpcError) as err:
            stub.GetJob(
                keel_pb2.GetJobRequest(job="nope"), metadata=call_metadata(TOKEN), timeout=5
            )
        assert err.value.code() is grpc.StatusCode.NOT_FOUND

        # A stream whose first message is not a Hello is refused with a reason.
        calls = stub.Connect(
            iter([keel_pb2.AgentMessage(steps=keel_pb2.StepReportBatch(job="x"))]),
            metadata=call_metadata(TOKEN),
            timeout=5,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(calls)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "first message" in err.value.details()
        # A Hello whose lease etcd never granted cannot register a node.
        calls = stub.Connect(
            iter(
                [
                    keel_pb2.AgentMessage(
                        hello=keel_pb2.Hello(
                            node="ghost", host="127.0.0.1", slots=1, lease_id=424242
                        )
                    )
                ]
            ),
            metadata=call_metadata(TOKEN),
            timeout=5,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(calls)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "lease 424242 of node ghost is not alive" in err.value.details()
        assert "ghost" not in cluster.store.nodes()
        # The controller is still serving, and neither the intruder nor the ghost is
        # among its nodes.
        assert (
            stub.ListNodes(
                keel_pb2.ListNodesRequest(), metadata=call_metadata(TOKEN), timeout=5
            ).nodes
            == []
        )


class ForgingAgent:
    """An agent's session driven by the test: a real Connect stream on a real etcd
    lease, sending what the test puts (``send``), the controller's messages kept in
    the order they came (``expect``)."""

    def __init__(self, stub, lease, node: str):
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        hello = keel_pb2.Hello(
            node=node, host="127.0.0.1", slots=1, lease_id=lease.id, pid=os.getpid()
        )

        def messages():
            yield keel_pb2.AgentMessage(hello=hello)
            while (message := self._out.get()) is not None:
                yield message

        self.stream = stub.Connect(messages(), metadata=call_metadata(TOKEN))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for message in self.stream:
                self._in.put(message)
        except grpc.RpcError:
            pass  # cancelled when the test is done

    def send(self, **kind):
        self._out.put(keel_pb2.AgentMessage(**kind))

    def expect(self, kind: str):
        """The next controller message of ``kind`` (those before it are passed over)."""
        while True:
            message = self._in.get(timeout=30)
            if message.WhichOneof("kind") == kind:
                return getattr(message, kind)

    def close(self):
        self._out.put(None)
        self.stream.cancel()


def test_a_forged_commit_is_refused_and_blocks_no_later_real_one(cluster):
    metrics_file = cluster.path / "controller.metrics"
    address = cluster.controller(
        launcher=(
            *("-m", "orchestrator.cli", "controller", "--metrics-listen", "127.0.0.1:0"),
            *("--metrics-address-file", str(metrics_file)),
        )
    )
    checkpoints = cluster.path / "checkpoints"
    lease = cluster.store.client.lease(30)
    with grpc.insecure_channel(address) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        agent = ForgingAgent(stub, lease, "node-f")
        try:
            wait_for(lambda: "node-f" in cluster.store.nodes(), 30, what="node-f registered")
            spec = keel_pb2.JobSpec(
                name="forged",
                world_size=1,
                command=["true"],
                checkpoint_dir=str(checkpoints),
                steps=20,
            )
            stub.SubmitJob(
                keel_pb2.SubmitJobRequest(spec=spec), metadata=call_metadata(TOKEN), timeout=5
            )
            # Placed on node-f (its only node, so rank 0's): the rendezvous, the start.
            prepare = agent.expect("prepare_rendezvous")
            agent.send(
                rendezvous_ready=keel_pb2.RendezvousReady(
                    job="forged", generation=prepare.generation, host="127.0.0.1", port=29500
                )
            )
            generation = agent.expect("start_generation").generation

            def commit(step, path):
                agent.send(
                    checkpoint_saved=keel_pb2.CheckpointSaved(
                        job="forged", generation=generation, step=step, path=path, samples=step
                    )
                )

            agent.send(
                steps=keel_pb2.StepReportBatch(
                    job="forged",
                    generation=generation,
                    node_steps=[keel_pb2.NodeStep(step=5, ranks=[0], step_time_s=[0.1])],
                )
            )
            # Rank 0 reported step 5. A commit of step 10**12 (at its committed path),
            # one of step 6, and one of step 5 outside the committed form are refused...
            commit(10**12, str(checkpoints / f"step_{10**12:08d}"))
            commit(6, str(checkpoints / "step_00000006"))
            commit(5, str(checkpoints / "elsewhere" / "step_00000005"))
            # ... and the real commit of step 5 after them is recorded.
            commit(5, str(checkpoints / "step_00000005"))
            recorded = wait_for(
                lambda: cluster.store.checkpoints("forged"), 30, what="the real commit recorded"
            )
            assert [(r.step, r.path) for r in recorded] == [(5, str(checkpoints / "step_00000005"))]
            scraped = (
                urllib.request.urlopen(
                    f"http://{metrics_file.read_text().strip()}/metrics", timeout=5
                )
                .read()
                .decode()
            )
            refused = re.search(
                r'^keel_agent_messages_refused_total\{kind="checkpoint_saved"\} (\S+)$',
                scraped,
                re.M,
            )
            assert refused and float(refused.group(1)) == 3, scraped
            log = (cluster.path / "controller.log").read_text()
            for why in ("past the job's 20 steps", "has reported step 5", "committed path"):
                assert why in log, why
        finally:
            agent.close()
            lease.revoke()
