"""Which memory snapshot the controller records for a job, and when a new generation
leaves it behind."""

import pytest

from common.records import MemorySnapshotRecord
from orchestrator.policy.authority import NodeAuthority, memory_snapshot_refusal
from orchestrator.policy.memory_snapshots import left_behind, supersedes

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


def test_a_snapshot_is_left_behind_by_a_generation_off_any_node_that_holds_it():
    assert left_behind(HELD, {"a", "b", "c"}) == []
    assert left_behind(HELD, {"c", "a"}) == ["b"]
    assert left_behind(HELD, {"c"}) == ["a", "b"]
    assert left_behind(None, {"c"}) == []


def test_only_rank_zeros_node_reports_a_memory_snapshot_within_the_jobs_steps():
    zero = NodeAuthority("a", 3, frozenset({0, 1}), commits=True, checkpoint_dir="/c")
    other = NodeAuthority("b", 3, frozenset({2, 3}), commits=False, checkpoint_dir="/c")
    assert memory_snapshot_refusal(zero, 41, 100) == ""
    assert memory_snapshot_refusal(zero, 41, 0) == ""  # no target: any step
    assert "rank 0 of generation 3" in memory_snapshot_refusal(other, 41, 100)
    assert "steps count from 1" in memory_snapshot_refusal(zero, 0, 100)
    assert "past the job's 100 steps" in memory_snapshot_refusal(zero, 101, 100)
