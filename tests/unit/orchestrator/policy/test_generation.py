"""The next generation's restore point, the nodes it leaves behind, and which
checkpoint records are kept, each as a table."""

import pytest

from common.records import CheckpointRecord
from orchestrator.policy.event_kind import EventKind
from orchestrator.policy.generation import (
    RESTORE_FALLBACKS,
    RestorePoint,
    nodes_left,
    restore_point,
    unrestorable,
)
from orchestrator.policy.retention import RECORDS_KEPT, records_to_prune


def record(step: int, quarantined: bool = False) -> CheckpointRecord:
    return CheckpointRecord(
        step=step,
        path=f"/c/step_{step:08d}",
        generation=1,
        samples=step,
        recorded_at_unix=0.0,
        quarantined=quarantined,
    )


@pytest.mark.parametrize(
    "records, expected",
    [
        ([], RestorePoint()),
        ([record(5, quarantined=True)], RestorePoint()),
        ([record(5)], RestorePoint("/c/step_00000005", 5, ())),
        (
            [record(5), record(10), record(15, quarantined=True)],
            RestorePoint("/c/step_00000010", 10, ("/c/step_00000005",)),
        ),
        (
            [record(s) for s in range(1, 7)],
            RestorePoint(
                "/c/step_00000006",
                6,
                tuple(f"/c/step_{s:08d}" for s in (5, 4, 3)),  # newest first, at most 3
            ),
        ),
    ],
)
def test_a_generation_restores_the_newest_good_checkpoint_and_falls_back_to_older(
    records, expected
):
    assert restore_point(records) == expected
    assert len(restore_point(records).fallbacks) <= RESTORE_FALLBACKS


A, B, C, D = "a", "b", "c", "d"


@pytest.mark.parametrize(
    "before, after, leaving, shrunk, expected",
    [
        ({A, B}, {A, B}, set(), False, None),
        ({A, B}, {A, B}, {B}, False, None),  # a suspect used again is not out
        ({A, B}, {A, C}, {B}, False, (EventKind.REPLACED, ("b",), "b replaced by c")),
        (
            {A, B, C},
            {A, D},
            {B, C},
            False,
            (EventKind.REPLACED, ("b", "c"), "b, c replaced by d"),
        ),
        (
            {A, B},
            {A},
            {B},
            True,
            (EventKind.EXCLUDED, ("b",), "b excluded; re-planned to dp_shard=2 at world size 2"),
        ),
        # a newcomer on a smaller layout still means the node was excluded
        (
            {A, B},
            {C},
            {A, B},
            True,
            (
                EventKind.EXCLUDED,
                ("a", "b"),
                "a, b excluded; re-planned to dp_shard=2 at world size 2",
            ),
        ),
        ({A}, {A, B}, {C}, False, None),  # a node that was never the job's is not out
    ],
)
def test_the_nodes_a_generation_leaves_behind_were_replaced_or_excluded(
    before, after, leaving, shrunk, expected
):
    left = nodes_left(
        frozenset(before), frozenset(after), frozenset(leaving), shrunk, "dp_shard=2", 2
    )
    assert (left and (left.how, left.out, left.reason)) == expected


def test_all_but_the_newest_records_are_pruned_unless_a_restore_point_uses_them():
    records = [record(s) for s in range(1, RECORDS_KEPT + 6)]
    assert records_to_prune(records, set()) == [1, 2, 3, 4, 5]
    assert records_to_prune(records, {"/c/step_00000002"}) == [1, 3, 4, 5]
    assert records_to_prune(records[:RECORDS_KEPT], set()) == []


@pytest.mark.parametrize(
    "sizes, kept",
    [
        ([], 0),
        ([10, 10, 10], 3),
        ([10] * 7, 5),  # at most five events
        ([60, 30, 30], 2),  # what fits in 100 bytes, newest first
        ([10, 500], 1),  # the newest is kept whatever its size
    ],
)
def test_a_job_keeps_its_newest_events_within_the_bounds(sizes, kept):
    from orchestrator.policy.retention import events_kept

    assert events_kept(sizes, max_events=5, max_bytes=100) == kept


def test_a_job_whose_every_checkpoint_failed_verification_cannot_go_on():
    assert unrestorable([]) == "", "a job that never recorded one starts fresh"
    assert unrestorable([record(5, quarantined=True), record(10)]) == ""
    bad = [
        record(5, quarantined=True),
        record(10, quarantined=True).replace(quarantine_reason="__0_0.distcp has 3 bytes"),
    ]
    assert unrestorable(bad) == (
        "no verifiable checkpoint: step 10 (/c/step_00000010): __0_0.distcp has 3 bytes; "
        "step 5 (/c/step_00000005): failed verification"
    )
