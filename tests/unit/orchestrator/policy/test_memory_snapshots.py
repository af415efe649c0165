"""Which memory snapshot the controller records for a job, with its copy on a partner;
which partner; and what a new generation's placement does with the snapshot."""

from dataclasses import replace

import pytest

from common.records import MemorySnapshotRecord
from orchestrator.policy.authority import NodeAuthority, memory_snapshot_refusal
from orchestrator.policy.memory_snapshots import (
    carried,
    partner,
    placed,
    repartnered,
    supersedes,
    with_replica,
)

HELD = MemorySnapshotRecord(
    step=40, generation=3, samples=640, bytes=1 << 20, nodes=("a", "b"), recorded_at_unix=1.0
)


@pytest.mark.parametrize(
    "generation, step, replaces",
    [
        (3, 41, True),  # the same generation, later
        (3, 40, False),  # a replay
        (3, 12, False),  # a replay of an older one, after a reconnect
        (4, 12, True),  # a later generation restored from further back and removed it
        (2, 90, False),  # a generation before the record's
    ],
)
def test_a_report_replaces_the_record_if_it_is_newer_in_generation_then_step(
    generation, step, replaces
):
    assert supersedes(HELD, generation, step) is replaces
    assert supersedes(None, generation, step)


def test_a_copy_is_kept_with_the_record_of_its_generation_up_to_the_snapshots_step():
    one = replace(HELD, nodes=("a",))
    copied = with_replica(one, 3, 38, "b")
    assert (copied.step, copied.replica_step, copied.replica_node) == (40, 38, "b")
    assert supersedes(one, 3, 40, replica_step=38)  # the same snapshot, now with a copy
    assert not supersedes(copied, 3, 40, replica_step=38)  # a replay
    assert with_replica(copied, 3, 37, "b") is None  # older than the copy recorded
    assert with_replica(one, 3, 41, "b") is None  # its snapshot's report comes first
    assert with_replica(one, 2, 38, "b") is None  # another generation's
    assert with_replica(one, 3, 38, "a") is None  # a node that holds the snapshot itself
    assert with_replica(None, 3, 38, "b") is None
    # A newer snapshot keeps the copy of its generation; a later generation's does not.
    newer = replace(one, step=41)
    assert carried(copied, newer).replica_step == 38
    assert carried(copied, replace(newer, generation=4)).replica_step == 0
    assert carried(None, newer) is newer


def test_the_same_copy_on_a_new_partner_replaces_the_lost_partners_in_the_record():
    """The partner holding the copy of step 38 was lost; the new one is given the
    newest snapshot, which may be that same step: the record names the new partner,
    else the copy seemed lost with the old one until a newer step's was whole."""
    one = replace(HELD, nodes=("a",))
    copied = with_replica(one, 3, 38, "b")
    moved = with_replica(copied, 3, 38, "c")
    assert (moved.replica_step, moved.replica_node) == (38, "c")
    assert supersedes(copied, 3, 40, replica_step=38, replica_node="c")
    assert with_replica(moved, 3, 38, "c") is None  # a replay
    assert not supersedes(moved, 3, 40, replica_step=38, replica_node="c")
    assert not supersedes(one, 3, 40, replica_step=0, replica_node="c")  # no copy at all


def test_a_lost_partner_is_replaced_by_another_chosen_as_at_the_start():
    nodes = {"a": "r1", "c": "r2", "d": "r2", "e": "r1"}
    assert repartnered("a", "b", nodes, {"a"}, {}) == "c"  # b lost: another rack first
    assert repartnered("a", "b", nodes, {"a"}, {"c": 1}) == "d"  # then the fewest
    assert repartnered("a", "c", nodes, {"a"}, {}) == ""  # c still serves: kept
    assert repartnered("a", "b", {"a": "r1"}, {"a"}, {}) == ""  # none other can
    assert repartnered("a", "b", nodes, {"a", "c"}, {}) == ""  # across nodes: none


COPIED = MemorySnapshotRecord(
    step=40,
    generation=3,
    samples=640,
    bytes=1 << 20,
    nodes=("a",),
    recorded_at_unix=1.0,
    replica_step=39,
    replica_node="b",
)


def test_a_generation_on_the_snapshots_nodes_keeps_it():
    assert placed(COPIED, {"a"}, {"a", "b"}, 20) == placed(HELD, {"a", "b"}, set(), 0)
    assert placed(COPIED, {"a"}, {"a", "b"}, 20).keep
    assert not placed(None, {"a"}, {"a"}, 20).keep


def test_a_generation_off_the_snapshots_node_restores_the_partners_copy():
    on_partner = placed(COPIED, {"b"}, {"b"}, 20)
    assert (on_partner.keep, on_partner.copy) == (False, ("a", 39, "b"))
    assert "restores the copy of step 39 or later on b (which it runs on)" in on_partner.reason
    caught_up = placed(replace(COPIED, replica_step=40), {"b"}, {"b"}, 20)
    assert "restores the copy of step 40 on b" in caught_up.reason
    fetched = placed(COPIED, {"c"}, {"b", "c"}, 20)
    assert fetched.copy == ("a", 39, "b") and "fetched to c" in fetched.reason


@pytest.mark.parametrize(
    "record, placement, alive, durable, why",
    [
        (replace(COPIED, replica_step=0), {"c"}, {"b", "c"}, 20, "no copy of it was replicated"),
        (
            COPIED,
            {"c"},
            {"c"},
            20,
            "its copy on b (step 39) was lost too: it restores from step 20",
        ),
        (COPIED, {"c"}, {"b", "c"}, 39, "is no newer than the durable checkpoint"),
        (COPIED, {"c", "d"}, {"b", "c", "d"}, 20, "restored on one node only"),
        (
            replace(COPIED, nodes=("a", "e")),
            {"a", "c"},
            {"a", "b", "c"},
            20,
            "held by e, which the new generation does not run on, and a snapshot of a job "
            "across nodes is not copied to partners: it restores from step 20",
        ),
        (HELD, {"c"}, {"c"}, 0, "it restores from no durable checkpoint"),
    ],
)
def test_a_snapshot_left_behind_with_no_usable_copy_goes_and_the_reason_says_why(
    record, placement, alive, durable, why
):
    decided = placed(record, placement, alive, durable)
    assert (decided.keep, decided.copy) == (False, None)
    assert "which the new generation does not run on" in decided.reason
    assert why in decided.reason


def test_the_partner_is_outside_the_failure_domain_then_the_least_loaded():
    nodes = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    assert partner("a", nodes, {"a"}, {}) == "c"  # another rack first
    assert partner("a", nodes, {"a"}, {"c": 2}) == "d"  # then the fewest partnerships
    assert partner("a", nodes, {"a"}, {"c": 1, "d": 1, "b": 0}) == "c"  # a rack before load
    assert partner("a", {"a": "", "b": "", "c": ""}, {"a"}, {"b": 1}) == "c"
    assert partner("a", {"a": "r1", "b": ""}, {"a"}, {}) == "b"  # "" is not the same
    assert partner("a", {"a": "r1"}, {"a"}, {}) == ""
    assert partner("a", {}, {"a"}, {}) == ""


def test_a_generation_across_nodes_gets_no_partner():
    # Its copies would restore nothing: one node's part is not the others' layout.
    nodes = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    assert partner("a", nodes, {"a", "b"}, {}) == ""
    assert partner("a", nodes, ["a", "a"], {}) == "c"  # two ranks, one node


def test_only_rank_zeros_node_reports_a_memory_snapshot_within_the_jobs_steps():
    zero = NodeAuthority("a", 3, frozenset({0, 1}), commits=True, checkpoint_dir="/c")
    other = NodeAuthority("b", 3, frozenset({2, 3}), commits=False, checkpoint_dir="/c")
    assert memory_snapshot_refusal(zero, 41, 100) == ""
    assert memory_snapshot_refusal(zero, 41, 0) == ""  # no target: any step
    assert "rank 0 of generation 3" in memory_snapshot_refusal(other, 41, 100)
    assert "steps count from 1" in memory_snapshot_refusal(zero, 0, 100)
    assert "past the job's 100 steps" in memory_snapshot_refusal(zero, 101, 100)
