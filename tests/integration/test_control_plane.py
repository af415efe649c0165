"""Real etcd, a real controller process and real agent processes."""

from __future__ import annotations

import signal

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
