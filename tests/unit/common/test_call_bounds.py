"""The request limits of each daemon: every method of its service has one, no limit is
above the server's (gRPC's own, which refuses from the length prefix), a streaming
method's is the server's (``call_bounds.bounded`` checks unary calls only: a stream's
messages are bounded there alone), and what an agent legitimately sends fits."""

import threading

import grpc
import pytest

from agent import local_server
from common import rpc
from common.call_bounds import RequestLimits, oversize_refusal
from common.steps import MAX_BATCH_REPORTS
from orchestrator.security.auth import METHOD_ROLES, SERVICE
from orchestrator.security.call_limits import CONTROLLER_LIMITS
from protos import keel_pb2, keel_pb2_grpc


def methods(service: str) -> dict[str, bool]:
    """Each method of ``service``, full name, and whether its request streams."""
    found = keel_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
    return {f"/keel.v1.{service}/{name}": method.client_streaming for name, method in found.items()}


@pytest.mark.parametrize(
    "service, limits",
    [("Controller", CONTROLLER_LIMITS), ("AgentLocal", local_server.LOCAL_LIMITS)],
)
def test_a_streaming_method_is_bounded_by_the_server_and_named_methods_exist(service, limits):
    known = methods(service)
    assert set(limits.per_method) <= set(known)
    for method, streaming in known.items():
        assert limits.of(method) <= limits.server_bytes
        if streaming:
            assert limits.of(method) == limits.server_bytes, method


def test_the_controllers_table_names_the_methods_of_its_role_table():
    assert set(methods("Controller")) | set(methods("Bootstrap")) == set(METHOD_ROLES)
    assert CONTROLLER_LIMITS.of(SERVICE + "GetJob") == 64 * 1024


def test_an_agents_largest_batch_fits_its_streams_limit():
    """A full batch, every rank report its own step of one rank (the largest shape)."""
    batch = keel_pb2.AgentMessage(
        steps=keel_pb2.StepReportBatch(
            job="j" * 64,
            generation=2**40,
            node_steps=[
                keel_pb2.NodeStep(
                    step=2**40,
                    ranks=[1023],
                    step_time_s=[1.5],
                    tokens=2**30,
                    at=1.7e9,
                    checkpoint_s=1.0,
                    restore_s=1.0,
                    loss=1.0,
                )
            ]
            * MAX_BATCH_REPORTS,
        )
    )
    assert batch.ByteSize() < CONTROLLER_LIMITS.of(SERVICE + "Connect") // 16


def test_a_request_is_refused_over_its_limit_only():
    assert oversize_refusal("/keel.v1.Controller/GetJob", 10, 10) == ""
    assert oversize_refusal("/keel.v1.Controller/GetJob", 11, 10) == (
        "a GetJob request of 11 bytes is over its limit of 10 bytes"
    )


def test_limits_are_positive():
    with pytest.raises(ValueError, match="positive"):
        RequestLimits(per_method={"/a/B": 0}, default_bytes=10)


def test_a_server_takes_no_more_calls_at_once_than_its_cap():
    """``rpc.server``'s ``max_rpcs``: with one call held in its handler, the next is
    refused at once (RESOURCE_EXHAUSTED), and taken again once the first is done."""
    entered, release = threading.Event(), threading.Event()

    class Held(keel_pb2_grpc.ControllerServicer):
        def GetJob(self, request, context):
            entered.set()
            release.wait(10)
            return keel_pb2.JobStatus()

    server = rpc.server(2, CONTROLLER_LIMITS, max_rpcs=1)
    keel_pb2_grpc.add_ControllerServicer_to_server(Held(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = keel_pb2_grpc.ControllerStub(channel)
            first = stub.GetJob.future(keel_pb2.GetJobRequest(job="a"), timeout=10)
            assert entered.wait(10)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetJob(keel_pb2.GetJobRequest(job="b"), timeout=10)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            release.set()
            first.result()
            stub.GetJob(keel_pb2.GetJobRequest(job="c"), timeout=10)
    finally:
        release.set()
        server.stop(0)
