"""Checkpoint problems the controller is told of: a failed save becomes a
``checkpoint_failed`` event with the rank's reason and is counted by kind in
``keel_checkpoint_problems_total``, where every kind is exported from 0."""

from common.wire_kinds import CheckpointProblemKind
from orchestrator.controller.checkpoint_records import CheckpointRecords
from orchestrator.policy.event_kind import WIRE_EVENT_KINDS, EventKind
from protos import keel_pb2
from tests.unit.orchestrator.controller.test_metrics import controller, job


def counted(registry, job_name: str) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == "keel_checkpoint_problems_total" and s.labels["job_name"] == job_name
    }


def test_a_failed_save_is_an_event_and_counted():
    state, registry = controller()
    j = state.jobs["j"] = job()
    assert counted(registry, "j") == {kind.value: 0 for kind in CheckpointProblemKind}
    reason = "the save of step 20 failed: OSError on rank 1: [Errno 28] No space left on device"
    j.checkpoint_problems.append(
        (
            "node-0",
            keel_pb2.CheckpointProblem(
                job="j",
                generation=1,
                step=20,
                path="/ckpt/.step_00000020.g1.tmp",
                kind=keel_pb2.CHECKPOINT_PROBLEM_KIND_SAVE_FAILED,
                reason=reason,
            ),
        )
    )
    CheckpointRecords(state).problems(j)
    (event,) = j.health.events
    assert WIRE_EVENT_KINDS.from_wire(event.kind) is EventKind.CHECKPOINT_FAILED
    assert event.step == 20
    assert event.reason == (
        f"generation 1's checkpoint of step 20 was not saved; training went on: {reason}"
    )
    assert j.checkpoint_problems == []
    assert counted(registry, "j")["save_failed"] == 1
    assert j.last_checkpoint is None, "a failed save is no checkpoint"
