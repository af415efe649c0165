"""The nodes a job's next generation stays off (``observe.suspects``) include repeat
offenders and the nodes checkpoint problems point at; an unreadable checkpoint is the
node's problem, and no checkpoint record is touched for it."""

from common.wire_kinds import WIRE_PROBLEM_KINDS, CheckpointProblemKind
from orchestrator.controller import observe
from orchestrator.controller.checkpoint_records import CheckpointRecords
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.state import ControllerState
from orchestrator.controller.store import Store
from orchestrator.policy.event_kind import WIRE_EVENT_KINDS, EventKind
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.offenders import NodeFailure
from protos import keel_pb2


def running_job(generation=4) -> JobRuntime:
    spec = keel_pb2.JobSpec(name="j", world_size=2, command=["x"], checkpoint_dir="/c")
    return JobRuntime.new(spec, JobState.RUNNING, 1, 0.0, generation=generation)


def records() -> CheckpointRecords:
    # A store without an etcd client: any call to it fails the test.
    config = ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t")
    return CheckpointRecords(ControllerState(config, Store(client=None)))


def problem(kind: CheckpointProblemKind, suspect_node: str = "") -> keel_pb2.CheckpointProblem:
    return keel_pb2.CheckpointProblem(
        job="j",
        generation=4,
        step=30,
        path="/c/step_00000030",
        kind=WIRE_PROBLEM_KINDS.to_wire(kind),
        reason="No such file or directory: '/c/step_00000030/.metadata'",
        suspect_node=suspect_node,
    )


def suspected_events(job: JobRuntime) -> list[tuple[str, str]]:
    return [
        (e.node, e.reason)
        for e in job.health.events
        if WIRE_EVENT_KINDS.text(e.kind) == EventKind.SUSPECTED
    ]


def test_an_unreadable_checkpoint_suspects_its_node_and_quarantines_nothing():
    job = running_job()
    job.checkpoint_problems.append(("n1", problem(CheckpointProblemKind.UNREACHABLE)))
    records().problems(job)  # no etcd call: the record stays as it is
    [(node, reason)] = suspected_events(job)
    assert node == "n1" and reason.startswith("the checkpoint of step 30 could not be read on n1")
    assert observe.suspects(job) == {"n1"}
    # For the next placement only.
    job.health.new_generation(5, {})
    assert observe.suspects(job) == frozenset()


def test_a_fence_timeout_suspects_the_node_holding_the_lock():
    job = running_job()
    job.checkpoint_problems.append(("n1", problem(CheckpointProblemKind.FENCE_TIMEOUT, "n3")))
    records().problems(job)
    assert [node for node, _ in suspected_events(job)] == ["n3"]
    assert observe.suspects(job) == {"n3"}


def test_a_repeat_offender_is_a_suspect_until_a_generation_runs_without_failing_there():
    job = running_job(generation=4)
    job.health.note_failure(NodeFailure(3, "n2", "rank 1 exited with code 1"))
    assert observe.suspects(job) == frozenset()
    job.health.note_failure(NodeFailure(4, "n2", "rank 1 exited with code 1"))
    assert observe.suspects(job) == {"n2"}
    job.generation = 5  # placed elsewhere; it ran without failing on n2
    assert observe.suspects(job) == frozenset()
