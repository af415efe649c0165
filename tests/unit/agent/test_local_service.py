"""The agent's socket: a rank speaks only for itself, with the token it was given."""

import grpc
import pytest

from agent import local_server
from common import env
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import AgentRecorder, local_agent


@pytest.fixture
def socket(tmp_path):
    recorder = AgentRecorder()
    # Rank 1 of generation 4 alone (the agent gives each rank a token of its own), and
    # rank 0, which commits into the job's checkpoint directory.
    rank1 = recorder.token_for(4, 2, tmp_path / "ckpt")
    recorder.identities[rank1] = recorder.identities[rank1].__class__(
        job="demo", generation=4, ranks=frozenset({1}), checkpoint_dir=str(tmp_path / "ckpt")
    )
    rank0 = recorder.token_for(4, 1, tmp_path / "ckpt", job="demo")
    with local_agent(recorder) as path, grpc.insecure_channel(f"unix:{path}") as channel:
        yield keel_pb2_grpc.AgentLocalStub(channel), recorder, rank0, rank1, tmp_path / "ckpt"


def call(method, request, token):
    metadata = ((env.RANK_TOKEN_METADATA, token),) if token else ()
    try:
        method(request, metadata=metadata, timeout=5)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def steps(generation, *ranks):
    return keel_pb2.LocalStepReports(
        generation=generation, reports=[keel_pb2.StepReport(rank=r, step=3) for r in ranks]
    )


def test_a_caller_without_a_live_ranks_token_is_refused(socket):
    stub, recorder, *_ = socket
    for token in ("", "made-up"):
        code, details = call(stub.ReportSteps, steps(4, 1), token)
        assert code is grpc.StatusCode.UNAUTHENTICATED and "KEEL_RANK_TOKEN" in details
    assert recorder.of("step") == []


def test_a_rank_reports_only_its_own_steps_in_its_own_generation(socket):
    stub, recorder, _, rank1, _ = socket
    assert call(stub.ReportSteps, steps(4, 1), rank1) == (grpc.StatusCode.OK, "")
    assert call(stub.ReportSteps, steps(4, 1, 0), rank1) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "a step report of rank 0: this caller is rank(s) [1]",
    )
    code, details = call(stub.ReportSteps, steps(3, 1), rank1)
    assert code is grpc.StatusCode.PERMISSION_DENIED and "belongs to generation 4" in details
    # Only the first call's report was passed on.
    assert [(r.rank, r.step) for r in recorder.of("step")] == [(1, 3)]


def test_only_rank_zero_commits_and_only_inside_the_checkpoint_directory(socket):
    stub, recorder, rank0, rank1, ckpt = socket

    def commit(path, token):
        return call(
            stub.ReportCheckpoint,
            keel_pb2.CheckpointSaved(job="demo", generation=4, step=10, path=str(path), samples=40),
            token,
        )

    assert commit(ckpt / "step_00000010", rank1)[0] is grpc.StatusCode.PERMISSION_DENIED
    for outside in ("/tmp/evil", ckpt / ".." / "other" / "step_00000010", ckpt, "step_00000010"):
        code, details = commit(outside, rank0)
        assert code is grpc.StatusCode.PERMISSION_DENIED and "not inside" in details, outside
    # A symbolic link inside that points outside is outside.
    ckpt.mkdir()
    (ckpt / "link").symlink_to("/tmp")
    assert commit(ckpt / "link" / "step_00000010", rank0)[0] is grpc.StatusCode.PERMISSION_DENIED
    assert recorder.of("checkpoint") == []
    assert commit(ckpt / "step_00000010", rank0) == (grpc.StatusCode.OK, "")
    assert [c.path for c in recorder.of("checkpoint")] == [str(ckpt / "step_00000010")]
    problem = keel_pb2.CheckpointProblem(
        job="demo",
        generation=4,
        step=10,
        kind=keel_pb2.CHECKPOINT_PROBLEM_KIND_QUARANTINED,
        path=str(ckpt / "step_00000010"),
        reason="bad",
    )
    assert (
        call(stub.ReportCheckpointProblem, problem, rank1)[0] is grpc.StatusCode.PERMISSION_DENIED
    )


def test_only_rank_zero_reports_a_memory_snapshot_and_only_of_its_own_job(socket):
    stub, recorder, rank0, rank1, _ = socket

    def report(token, job="", step=6, generation=4):
        return call(
            stub.ReportMemorySnapshot,
            keel_pb2.MemorySnapshotSaved(job=job, generation=generation, step=step, samples=24),
            token,
        )

    assert report(rank1)[0] is grpc.StatusCode.PERMISSION_DENIED
    assert report(rank0, generation=3)[0] is grpc.StatusCode.PERMISSION_DENIED
    code, details = report(rank0, job="other")
    assert code is grpc.StatusCode.PERMISSION_DENIED and "belongs to job" in details
    code, details = report(rank0, step=0)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "step" in details
    assert recorder.of("memory_snapshot") == []
    assert report(rank0) == (grpc.StatusCode.OK, "")
    # Passed on as the rank's job's, whether or not the rank named it.
    (saved,) = recorder.of("memory_snapshot")
    assert (saved.job, saved.generation, saved.step, saved.samples) == ("demo", 4, 6, 24)
    assert report(rank0, job="demo", step=7) == (grpc.StatusCode.OK, "")


def test_a_rank_attaches_as_itself(socket):
    stub, recorder, _, rank1, _ = socket
    attach = keel_pb2.RankAttach
    assert call(stub.Attach, attach(generation=4, rank=1), rank1) == (grpc.StatusCode.OK, "")
    assert call(stub.Attach, attach(generation=4, rank=0), rank1) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "an attach of rank 0: this caller is rank(s) [1]",
    )
    assert call(stub.Attach, attach(generation=4, rank=1), "")[0] is grpc.StatusCode.UNAUTHENTICATED
    assert recorder.of("attach") == [(4, 1)]


def test_restart_in_place_over_the_socket_is_a_ranks_own_business(socket):
    """A rank that can restart in place says so when it attaches, hears in its acks
    that it is asked to leave, parks only as itself, and only a parked process's token
    gets an answer to NextGeneration."""
    stub, recorder, _, rank1, _ = socket
    attach = keel_pb2.RankAttach(generation=4, rank=1, restart_in_place=True)
    ack = stub.Attach(attach, metadata=((env.RANK_TOKEN_METADATA, rank1),), timeout=5)
    assert not ack.leave_generation and ("restart_in_place", (4, 1)) in recorder.events
    recorder.leaving_tokens.add(rank1)
    ack = stub.ReportSteps(steps(4, 1), metadata=((env.RANK_TOKEN_METADATA, rank1),), timeout=5)
    assert ack.leave_generation

    park = keel_pb2.RankPark(generation=4, rank=1, failed=True, reason="peer gone")
    assert call(stub.Park, park, "")[0] is grpc.StatusCode.UNAUTHENTICATED
    assert call(stub.Park, keel_pb2.RankPark(generation=4, rank=0), rank1) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "a park of rank 0: this caller is rank(s) [1]",
    )
    recorder.refuse_park = "its job asked for fresh processes (cold_start)"
    assert call(stub.Park, park, rank1) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "not kept for restart in place: its job asked for fresh processes (cold_start)",
    )
    recorder.refuse_park = None
    assert call(stub.Park, park, rank1) == (grpc.StatusCode.OK, "")
    assert [p.reason for kind, p in recorder.events if kind == "park"] == ["peer gone"] * 2

    ask = keel_pb2.NextGenerationRequest()
    code, details = call(stub.NextGeneration, ask, rank1)
    assert code is grpc.StatusCode.UNAUTHENTICATED and "parked" in details
    recorder.answers[rank1] = keel_pb2.NextGenerationAnswer(
        action=keel_pb2.NEXT_GENERATION_ACTION_START, env={"RANK": "3"}, stdout="/o", stderr="/e"
    )
    answer = stub.NextGeneration(ask, metadata=((env.RANK_TOKEN_METADATA, rank1),), timeout=5)
    assert (answer.action, dict(answer.env), answer.stdout) == (
        keel_pb2.NEXT_GENERATION_ACTION_START,
        {"RANK": "3"},
        "/o",
    )


def test_a_caller_without_a_token_is_refused_before_its_request_is_read(socket):
    """The token is judged on the call's metadata: a request far over every limit is
    still UNAUTHENTICATED (gRPC would refuse it as too large were it read), and a
    parked process's token alone opens NextGeneration."""
    stub, recorder, _, rank1, _ = socket
    huge = keel_pb2.LocalStepReports(
        generation=4, reports=[keel_pb2.StepReport(rank=1, step=3)] * 600_000
    )
    assert huge.ByteSize() > 2 * local_server.LOCAL_LIMITS.server_bytes
    for token in ("", "made-up"):
        assert call(stub.ReportSteps, huge, token) == (
            grpc.StatusCode.UNAUTHENTICATED,
            local_server.NO_RANK_TOKEN,
        )
    assert call(stub.NextGeneration, keel_pb2.NextGenerationRequest(), rank1) == (
        grpc.StatusCode.UNAUTHENTICATED,
        local_server.NO_PARKED_TOKEN,
    )
    assert recorder.of("step") == []


def test_a_ranks_request_over_its_methods_limit_is_refused_unparsed(socket):
    stub, recorder, rank0, rank1, _ = socket
    # Over the default limit (a commit's path), under the server's: refused by the
    # method's own limit, naming it.
    path = "/ckpt/" + "x" * (64 * 1024)
    code, details = call(
        stub.ReportCheckpoint, keel_pb2.CheckpointSaved(generation=4, step=1, path=path), rank0
    )
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "a ReportCheckpoint request of" in details and "limit of 65536 bytes" in details
    # Over the server's limit: gRPC's own refusal.
    code, details = call(stub.ReportSteps, steps(4, *[1] * 250_000), rank1)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    assert recorder.of("step") == [] and recorder.of("checkpoint") == []
    # A report of the largest size an agent takes passes.
    full = steps(4, *[1] * local_server.MAX_REPORTS_PER_CALL)
    assert full.ByteSize() < local_server.LOCAL_LIMITS.of(local_server.SERVICE + "ReportSteps")
    assert call(stub.ReportSteps, full, rank1) == (grpc.StatusCode.OK, "")
