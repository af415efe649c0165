"""Malformed and random messages against a real controller: it stays up, answers each
with a status, and etcd changes only by what it accepted."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.tls import call_metadata
from protos import keel_pb2, keel_pb2_grpc
from tests.integration.conftest import TOKEN

text = st.text(max_size=80)
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
uint64 = st.integers(min_value=0, max_value=2**64 - 1)

specs = st.builds(
    keel_pb2.JobSpec,
    name=text,
    world_size=uint32,
    command=st.lists(text, max_size=4),
    env=st.dictionaries(text, text, max_size=3),
    max_restarts=uint32,
    steps=uint64,
    checkpoint_dir=text,
    mesh=text,
    min_nodes=uint32,
    health=st.builds(
        keel_pb2.HealthSpec,
        straggler_policy=st.integers(min_value=0, max_value=2**31 - 1),  # unknown ones too
        hang_floor_s=st.floats(allow_nan=True),
        hang_k=st.floats(allow_nan=True),
    ),
)
hellos = st.builds(
    keel_pb2.Hello,
    node=text,
    host=text,
    slots=uint32,
    lease_id=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    pid=uint32,
)
agent_messages = st.one_of(
    st.builds(lambda h: keel_pb2.AgentMessage(hello=h), hellos),
    st.builds(
        lambda j, g, r, c: keel_pb2.AgentMessage(
            rank_exited=keel_pb2.RankExited(job=j, generation=g, rank=r, exit_code=c)
        ),
        text,
        uint64,
        uint32,
        st.integers(min_value=-(2**31), max_value=2**31 - 1),
    ),
    st.builds(
        lambda j, g: keel_pb2.AgentMessage(
            steps=keel_pb2.StepReportBatch(
                job=j,
                generation=g,
                node_steps=[keel_pb2.NodeStep(step=g % 1000, ranks=[1], step_time_s=[0.0])],
            )
        ),
        text,
        uint64,
    ),
    st.builds(
        lambda j, g, p: keel_pb2.AgentMessage(
            checkpoint_saved=keel_pb2.CheckpointSaved(job=j, generation=g, path=p)
        ),
        text,
        uint64,
        text,
    ),
    st.builds(
        lambda j, p: keel_pb2.AgentMessage(
            rendezvous_ready=keel_pb2.RendezvousReady(job=j, port=p)
        ),
        text,
        uint32,
    ),
    st.builds(
        lambda j, g: keel_pb2.AgentMessage(
            hang_detected=keel_pb2.HangDetected(
                job=j, generation=g, phase=keel_pb2.HANG_PHASE_STEP, stacks={0: "x"}
            )
        ),
        text,
        uint64,
    ),
    st.just(keel_pb2.AgentMessage()),
)


def etcd_snapshot(store) -> dict:
    return {
        meta.key: value
        for value, meta in store.client.get_prefix("/keel/")
        if not meta.key.startswith(b"/keel/controller/")
    }


def test_random_requests_never_take_the_controller_down_or_touch_etcd(cluster):
    address = cluster.controller()
    before = etcd_snapshot(cluster.store)
    accepted: list[str] = []
    with grpc.insecure_channel(address) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        metadata = call_metadata(TOKEN)

        @settings(
            max_examples=120,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(
            spec=specs, job=text, node=text, stream=st.lists(agent_messages, min_size=1, max_size=4)
        )
        def poke(spec, job, node, stream):
            try:
                stub.SubmitJob(keel_pb2.SubmitJobRequest(spec=spec), metadata=metadata, timeout=5)
                accepted.append(spec.name)
            except grpc.RpcError as err:
                assert err.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.ALREADY_EXISTS,
                ), err
            try:
                stub.GetJob(keel_pb2.GetJobRequest(job=job), metadata=metadata, timeout=5)
            except grpc.RpcError as err:
                assert err.code() is grpc.StatusCode.NOT_FOUND, err
            for method, request in [
                ("CordonNode", keel_pb2.NodeRequest(node=node, reason=job)),
                ("UncordonNode", keel_pb2.NodeRequest(node=node)),
                ("DrainNode", keel_pb2.NodeRequest(node=node, reason=job)),
                ("ReplaceNode", keel_pb2.ReplaceNodeRequest(node=node, with_node=job)),
                ("CheckpointJob", keel_pb2.CheckpointJobRequest(job=job)),
                ("StopJob", keel_pb2.StopJobRequest(job=job, reason=node)),
            ]:
                try:
                    getattr(stub, method)(request, metadata=metadata, timeout=5)
                    # Only a stop of a job it accepted can succeed: no node is known.
                    assert method == "StopJob" and job in accepted, method
                except grpc.RpcError as err:
                    assert err.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.FAILED_PRECONDITION,
                    ), (method, err)
            try:
                list(stub.Connect(iter(stream), metadata=metadata, timeout=2))
            except grpc.RpcError as err:
                # Refused hellos, or the stream ending at our deadline; never a crash.
                assert err.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                ), err

        poke()
        # Still serving, and etcd holds only the jobs it accepted: no node was
        # registered on a lease nobody granted.
        assert stub.ListNodes(keel_pb2.ListNodesRequest(), metadata=metadata, timeout=5).nodes == []
    after = etcd_snapshot(cluster.store)
    new_keys = {key.decode() for key in set(after) - set(before)}
    assert all(key.split("/")[3] in accepted for key in new_keys), new_keys
    assert not [k for k in new_keys if k.startswith(("/keel/nodes/", "/keel/cordons/"))]
