"""The stored records: each prints and parses back to itself, and a value that does not
parse is refused with its key and what is wrong with it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common import keys
from common.records import (
    CheckpointRecord,
    CheckpointRequestRecord,
    CordonRecord,
    EpochRecord,
    EventRecord,
    GoodputRecord,
    JobSpecRecord,
    JobState,
    JobStateRecord,
    LeaderRecord,
    MemorySnapshotRecord,
    NodeRecord,
    OperationRecord,
    PlanPartsRecord,
    PlanRecord,
    RecordError,
    newest_good,
)
from protos import keel_pb2

GOODPUT = GoodputRecord(
    start_unix=1.0,
    cursor_unix=2.5,
    seconds={"productive": 1.0, "restart": 0.5},
    phase="running",
    ran=True,
    ended=False,
    at_risk=[(7, 0.25)],
    generation=2,
    world_size=4,
    last_step=7,
)
JOB_STATE = JobStateRecord(
    state=JobState.RUNNING,
    generation=2,
    restarts=1,
    reason="generation 2: 4 ranks",
    failures=[keel_pb2.Failure(generation=1, node="a", rank=3, exit_code=1, traceback="boom")],
    initial_loss=5.5,
    stop_requested="",
    stop_now=False,
    planned_stop=False,
    ended_at_unix=None,
    goodput=GOODPUT,
    restarts_by_cause={"crash": 1},
    checkpoint_problems={},
    state_seconds={"PENDING": 0.5},
    state_entered_at_unix=3.0,
    tokens=1024,
    step=7,
)
EXAMPLES = {
    keys.LEADER: LeaderRecord(address="10.0.0.1:7070", id="ctl-a", epoch=1),
    keys.EPOCH: EpochRecord(
        epoch=2, previous=1, at_unix=6.0, by="keel restore-epoch on ops-1", restored_revision=812
    ),
    keys.node("a"): NodeRecord(host="10.0.0.2", slots=8, pid=12, lease_id=99),
    keys.cordon("a"): CordonRecord(reason="bad fan", by="operator", drain=True, at_unix=1.5),
    keys.job_spec("j"): JobSpecRecord(
        spec=keel_pb2.JobSpec(name="j", world_size=4, command=["python", "train.py"])
    ),
    keys.job_state("j"): JOB_STATE,
    keys.plan("j", 2): PlanRecord(
        generation=2,
        world_size=4,
        master_addr="10.0.0.2",
        master_port=29500,
        nodes={"a": [0, 1], "b": [2, 3]},
        restore_from="/c/step_00000005",
        restore_fallbacks=[],
        command=["python", "train.py"],
        mesh="dp_shard=4",
        agents={"a": 12, "b": 13},
        deadlines=keel_pb2.Deadlines(hang_floor_s=30.0),
        created_at_unix=4.0,
    ),
    keys.plan("j", 3): PlanPartsRecord(generation=3, parts=12, size=3_000_000, sha256="ab" * 32),
    keys.checkpoint("j", 5): CheckpointRecord(
        step=5, path="/c/step_00000005", generation=2, samples=80, recorded_at_unix=5.0
    ),
    keys.memory_snapshot("j"): MemorySnapshotRecord(
        step=7, generation=2, samples=112, bytes=4096, nodes=("a",), recorded_at_unix=6.5
    ),
    keys.event("j", 1): EventRecord(
        event=keel_pb2.Event(kind=keel_pb2.EVENT_KIND_CRASH, node="a", rank=0, seq=1)
    ),
    keys.operation("j"): OperationRecord(
        node="a", reason="operator: replace a", policy="replace", generation=2
    ),
    keys.checkpoint_request("j"): CheckpointRequestRecord(
        generation=2, after_step=7, reason="requested by the operator"
    ),
}


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_every_record_parses_back_to_itself(key):
    record = EXAMPLES[key]
    text = record.to_json()
    assert json.loads(text)["schema"] == 1
    assert type(record).from_json(key, text) == record
    assert type(record).from_json(key, text.encode()) == record


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"not json at all", "JSON is malformed"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b'{"reason": "r", "by": "operator", "drain": "yes", "at_unix": 1}', "at `$.drain`"),
        (b'{"reason": "r", "by": "operator", "drain": true}', "missing required field `at_unix`"),
        (
            b'{"schema": 2, "reason": "r", "by": "operator", "drain": true, "at_unix": 1}',
            "CordonRecord of schema 2; this version reads 1",
        ),
    ],
)
def test_a_value_that_does_not_parse_is_refused_with_its_key_and_the_fault(raw, problem):
    key = keys.cordon("not-a-node")
    with pytest.raises(RecordError) as refused:
        CordonRecord.from_json(key, raw)
    assert refused.value.key == key
    message = str(refused.value)
    assert message.startswith(f"{key}: ") and "CordonRecord" in message
    assert problem in message


def test_a_job_state_with_a_field_of_the_wrong_type_or_an_unknown_state_is_refused():
    good = json.loads(JOB_STATE.to_json())
    key = keys.job_state("j")
    for change, where in [
        ({"generation": "two"}, "$.generation"),
        ({"state": "DREAMING"}, "$.state"),
        ({"goodput": {**good["goodput"], "seconds": {"productive": "lots"}}}, "$.goodput.seconds"),
        ({"failures": [{"exitCode": "one"}]}, "Failure"),
    ]:
        with pytest.raises(RecordError, match=key) as refused:
            JobStateRecord.from_json(key, json.dumps(good | change))
        assert where in str(refused.value), (change, str(refused.value))


def test_an_epoch_that_does_not_grow_is_refused_and_a_leader_of_old_reads_as_epoch_0():
    key = keys.EPOCH
    good = json.loads(EXAMPLES[key].to_json())
    for change in ({"epoch": 1}, {"epoch": 0, "previous": 0}, {"previous": -1}):
        with pytest.raises(RecordError, match="an epoch only grows"):
            EpochRecord.from_json(key, json.dumps(good | change))
    old = LeaderRecord.from_json(keys.LEADER, '{"schema": 1, "address": "a:1", "id": "c"}')
    assert old.epoch == 0


def test_a_spec_that_is_not_a_job_spec_is_refused():
    with pytest.raises(RecordError, match="not a JobSpec"):
        JobSpecRecord.from_json(
            keys.job_spec("j"), json.dumps({"schema": 1, "spec": {"worldSize": "many"}})
        )


@given(
    st.lists(
        st.tuples(st.integers(1, 10**9), st.booleans()),
        unique_by=lambda t: t[0],
        max_size=20,
    )
)
def test_the_newest_good_checkpoint_is_the_newest_not_quarantined(steps):
    records = [
        CheckpointRecord(
            step=step,
            path=f"/c/{step}",
            generation=1,
            samples=0,
            recorded_at_unix=0.0,
            quarantined=bad,
        )
        for step, bad in sorted(steps)
    ]
    good = [r for r in records if not r.quarantined]
    assert newest_good(records) == (good[-1] if good else None)


KINDS = {
    LeaderRecord: "leader",
    EpochRecord: "epoch",
    NodeRecord: "node",
    CordonRecord: "cordon",
    JobSpecRecord: "job_spec",
    JobStateRecord: "job_state",
    PlanRecord: "plan",
    PlanPartsRecord: "plan",
    CheckpointRecord: "checkpoint",
    MemorySnapshotRecord: "memory_snapshot",
    EventRecord: "event",
    OperationRecord: "operation",
    CheckpointRequestRecord: "checkpoint_request",
}


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_each_key_is_labelled_with_the_record_it_holds(key):
    assert keys.kind_of(key) == KINDS[type(EXAMPLES[key])]
    assert keys.kind_of(keys.plan_parts("j", 3, "ab" * 32) + "000001") == "plan"
    assert keys.kind_of("/keel/jobs/j/unknown") == keys.kind_of("/elsewhere") == "other"
