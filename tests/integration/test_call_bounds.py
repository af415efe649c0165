"""Bounds before trust (common/call_bounds), against a real etcd and a real controller:
a caller without a token cannot make the controller process hold the messages it
sends, whatever their size; a caller with one is held to each method's limit; a
Connect that says no Hello is closed after the Hello deadline; a batch of step reports
too large, or of a job that does not exist, is refused before the state lock is taken;
the session of an agent down for long is forgotten."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from common import deadlines
from common.etcd import connect
from common.steps import MAX_BATCH_REPORTS
from common.tls import call_metadata
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.daemon import Controller
from orchestrator.policy import retention
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import wait_for
from tests.integration.conftest import TOKEN

MIB = 1024 * 1024
MESSAGES, MESSAGE_MIB = 50, 32
# What the controller's peak RSS may grow by while it refuses them all: a fraction of
# one message. Holding any one of them would cost it 32 MiB.
GROWTH_BOUND_MIB = 12


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident set now (VmRSS) and at its peak so far (VmHWM), MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return fields


def refusal(method, request, metadata=(), timeout=30) -> tuple[grpc.StatusCode, str]:
    try:
        method(request, metadata=metadata, timeout=timeout)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_unauthenticated_messages_of_32_mib_do_not_grow_the_controllers_memory(cluster):
    address = cluster.controller()
    (proc,) = cluster.controllers
    options = [("grpc.max_send_message_length", 128 * MIB)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        # The controller warmed up: a call it serves, so that what it allocates for a
        # first call is in the figure before.
        assert refusal(stub.ListJobs, keel_pb2.ListJobsRequest(), call_metadata(TOKEN))[0] is (
            grpc.StatusCode.OK
        )
        big = keel_pb2.SubmitJobRequest(
            spec=keel_pb2.JobSpec(name="x", command=["y" * (MESSAGE_MIB * MIB)])
        )
        before = memory_mib(proc.pid)
        for i in range(MESSAGES):
            # No token, a wrong one, and the right one in the wrong form, in turn.
            metadata = [(), call_metadata("not-the-token"), (("authorization", TOKEN),)][i % 3]
            code, details = refusal(stub.SubmitJob, big, metadata)
            assert code is grpc.StatusCode.UNAUTHENTICATED, (code, details)
            missing = "missing token: send 'authorization: Bearer <token>'"
            assert details == (missing if not metadata else "wrong token")
        after = memory_mib(proc.pid)
        growth = after["VmHWM"] - before["VmRSS"]
        print(
            f"{MESSAGES} unauthenticated {MESSAGE_MIB} MiB messages: controller RSS "
            f"{before['VmRSS']:.1f} -> {after['VmRSS']:.1f} MiB, peak {before['VmHWM']:.1f} -> "
            f"{after['VmHWM']:.1f} MiB (peak over the RSS before: {growth:+.1f} MiB)"
        )
        assert growth < GROWTH_BOUND_MIB, (before, after)

        # With the token: a spec over SubmitJob's 1 MiB is refused unparsed, naming its
        # limit; one over the server's 64 MiB by gRPC, from its length prefix.
        code, details = refusal(
            stub.SubmitJob,
            keel_pb2.SubmitJobRequest(spec=keel_pb2.JobSpec(name="x", command=["y" * (2 * MIB)])),
            call_metadata(TOKEN),
        )
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "a SubmitJob request of" in details and f"limit of {MIB} bytes" in details
        code, details = refusal(
            stub.SubmitJob,
            keel_pb2.SubmitJobRequest(spec=keel_pb2.JobSpec(name="x", command=["y" * (65 * MIB)])),
            call_metadata(TOKEN),
        )
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
        assert memory_mib(proc.pid)["VmHWM"] - before["VmRSS"] < GROWTH_BOUND_MIB
        jobs = stub.ListJobs(keel_pb2.ListJobsRequest(), metadata=call_metadata(TOKEN), timeout=10)
        assert list(jobs.jobs) == []


def test_a_connect_that_says_no_hello_is_closed_after_the_hello_deadline(cluster):
    address = cluster.controller()
    with grpc.insecure_channel(address) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        silent = threading.Event()

        def nothing():
            silent.wait()  # the stream stays open and says nothing
            yield from ()

        began = time.monotonic()
        call = stub.Connect(nothing(), metadata=call_metadata(TOKEN))
        try:
            with pytest.raises(grpc.RpcError) as raised:
                next(call)
        finally:
            silent.set()
        took = time.monotonic() - began
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert raised.value.details() == (
        f"no Hello within {deadlines.HELLO_TIMEOUT_S:g} s of opening the stream: "
        f"an agent's stream opens with its Hello"
    )
    assert took >= deadlines.HELLO_TIMEOUT_S


class AgentStream:
    """A Connect of a made-up agent to an in-process controller: its Hello on a real
    lease, then whatever the test ``send``s."""

    def __init__(self, address: str, lease_id: int, node: str = "node-a"):
        self.outbox: queue.Queue = queue.Queue()
        self.outbox.put(
            keel_pb2.AgentMessage(
                hello=keel_pb2.Hello(node=node, host="127.0.0.1", slots=1, lease_id=lease_id)
            )
        )
        options = [("grpc.max_send_message_length", 128 * MIB)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.call = keel_pb2_grpc.ControllerStub(self.channel).Connect(
            iter(self.outbox.get, None), metadata=call_metadata("t")
        )
        assert next(self.call).WhichOneof("kind") == "welcome"

    def send(self, message: keel_pb2.AgentMessage) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def leader(etcd):
    controller = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t"))
    address = controller.serve()
    wait_for(lambda: controller.state.is_leader, 30, what="the controller to lead")
    client = connect([etcd.endpoint], 5)
    try:
        yield controller, address, client.lease(30).id
    finally:
        controller.shutdown()


def refused_batches() -> float:
    return REGISTRY.get_sample_value("keel_agent_messages_refused_total", {"kind": "steps"})


def batch(job: str, entries: int) -> keel_pb2.AgentMessage:
    step = keel_pb2.NodeStep(step=1, ranks=[0], step_time_s=[0.1], tokens=1, at=1.0)
    return keel_pb2.AgentMessage(
        steps=keel_pb2.StepReportBatch(job=job, generation=1, node_steps=[step] * entries)
    )


def test_a_batch_too_large_or_of_no_job_is_refused_before_the_state_lock(leader):
    """Refused while the test holds the state lock: nothing of it waited for the lock,
    and nothing of it reached the state; the stream stays up."""
    controller, address, lease_id = leader
    state = controller.state
    agent = AgentStream(address, lease_id)
    try:
        wait_for(lambda: "node-a" in state.sessions, 10, what="the session")
        before = refused_batches()
        with state.lock:
            agent.send(batch("no-such-job", 100))
            agent.send(batch("no-such-job", MAX_BATCH_REPORTS + 1))
            wait_for(lambda: refused_batches() == before + 2, 10, what="two refusals")
        session = state.sessions["node-a"]
        assert session.connected and session.batch_refused
    finally:
        agent.close()


def test_the_session_of_an_agent_down_for_long_is_forgotten(leader):
    controller, address, lease_id = leader
    state = controller.state
    agent = AgentStream(address, lease_id)
    wait_for(lambda: "node-a" in state.sessions, 10, what="the session")
    agent.close()
    wait_for(lambda: not state.sessions["node-a"].connected, 10, what="the stream to go down")
    with state.lock:
        down_at = state.sessions["node-a"].disconnected_at
        controller.reconciler.forget_stale_sessions(down_at + retention.SESSION_KEPT_S / 2)
        assert "node-a" in state.sessions  # not yet
        controller.reconciler.forget_stale_sessions(down_at + retention.SESSION_KEPT_S + 1)
        assert "node-a" not in state.sessions and "node-a" not in state.down
