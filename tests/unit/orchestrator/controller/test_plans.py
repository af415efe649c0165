"""The plan record: written from one JobRuntime, stored, read back into another."""

import pytest

from common.records import CheckpointRecord, PlanRecord
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.plans import adopt_plan, plan_record
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.placement import NodeRanks
from protos import keel_pb2


def job(state=JobState.PENDING) -> JobRuntime:
    spec = keel_pb2.JobSpec(name="j", world_size=4, command=["python", "train.py"])
    return JobRuntime.new(spec, state, 1, 0.0)


def test_a_plan_read_back_gives_what_it_takes_to_start_the_generation_again():
    records = [
        CheckpointRecord(
            step=step, path=f"/c/step_{step:08d}", generation=2, samples=0, recorded_at_unix=0.0
        )
        for step in (10, 20)
    ]
    planned = dict(
        generation=3,
        placement=[NodeRanks("a", (0, 1)), NodeRanks("b", (2, 3))],
        world_size=4,
        mesh="dp_shard=4",
        rendezvous=("10.0.0.1", 29500),
        placed_agents={"a": 11, "b": 12},
        deadlines=keel_pb2.Deadlines(hang_floor_s=30.0, collective_timeout_s=60.0),
        restore_from="/c/step_00000020",
        restore_fallbacks=["/c/step_00000010"],
    )
    written = plan_record(job(), **planned)
    assert written.command == ["python", "train.py"]
    record = PlanRecord.from_json("/keel/jobs/j/generations/3", written.to_json())
    assert record == written
    back = job(JobState.RUNNING)
    adopt_plan(back, record, records)
    for name, value in planned.items():
        if name != "generation":
            assert getattr(back, name) == value, name
    assert back.restore_step == 20


def test_a_plan_written_at_starting_has_no_rendezvous_yet():
    record = plan_record(
        job(),
        generation=1,
        placement=[NodeRanks("a", (0,))],
        world_size=1,
        mesh="dp_shard=1",
        rendezvous=None,
        placed_agents={"a": 5},
        deadlines=None,
        restore_from="",
        restore_fallbacks=[],
    )
    back = job(JobState.STARTING)
    adopt_plan(back, PlanRecord.from_json("plan", record.to_json()), [])
    assert back.rendezvous is None and back.placement == [NodeRanks("a", (0,))]
    assert back.restore_from == "" and back.restore_step is None and back.deadlines is None


def test_a_finished_jobs_plan_gives_its_layout_but_no_placement():
    record = plan_record(
        job(),
        generation=1,
        placement=[NodeRanks("a", (0,))],
        world_size=1,
        mesh="dp_shard=1",
        rendezvous=("h", 1),
        placed_agents={},
        deadlines=None,
        restore_from="",
        restore_fallbacks=[],
    )
    back = job(JobState.SUCCEEDED)
    adopt_plan(back, record, [])
    assert (back.world_size, back.mesh, back.placement) == (1, "dp_shard=1", [])


def test_an_unknown_plan_field_is_a_mistake_not_silence():
    with pytest.raises(TypeError, match="no plan field placemnt"):
        plan_record(job(), placemnt=[])
