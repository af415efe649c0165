"""What a node may report: only its own ranks; commits only from rank 0's node, at the
committed path of their step in the job's directory, no further than the job has come;
problems that quarantine or suspect only from the current generation's rank 0."""

import os

import pytest

from common.wire_kinds import CheckpointProblemKind
from orchestrator.policy.authority import (
    CommitBounds,
    NodeAuthority,
    checkpoint_refusal,
    committed_path,
    problem_refusal,
    rank_refusal,
)
from trainer import checkpoint_dir


def node(ranks=(2, 3), directory="/ckpt/job"):
    return NodeAuthority(
        node="b", generation=4, ranks=frozenset(ranks), commits=0 in ranks, checkpoint_dir=directory
    )


# Recorded up to step 10; rank 0 has reported step 25; the job runs 40 steps.
BOUNDS = CommitBounds(recorded_step=10, reported_step=25, target_steps=40)


def test_a_node_speaks_only_for_its_own_ranks():
    assert rank_refusal(node(), 3) == ""
    assert rank_refusal(node(), 0) == (
        "b reported rank 0 of generation 4, which it does not host (its ranks: [2, 3])"
    )


def test_only_rank_zeros_node_records_a_commit():
    assert "rank 0 of generation 4 (the committing rank) is not on it" in checkpoint_refusal(
        node(), BOUNDS, 20, "/ckpt/job/step_00000020"
    )
    assert checkpoint_refusal(node((0, 1)), BOUNDS, 20, "/ckpt/job/step_00000020") == ""


@pytest.mark.parametrize(
    "bounds, step, path, refused",
    [
        # The committed path of a step after the last recorded, up to rank 0's step.
        (BOUNDS, 20, "/ckpt/job/step_00000020", ""),
        (BOUNDS, 25, "/ckpt/job/step_00000025", ""),
        (BOUNDS, 11, "/ckpt/job/./step_00000011", ""),  # by normalized text
        # Past rank 0's step, or past the job's target: a bug, or forged.
        (BOUNDS, 26, "/ckpt/job/step_00000026", "rank 0 of generation 4 has reported step 25"),
        (BOUNDS, 10**12, f"/ckpt/job/step_{10**12:08d}", "past the job's 40 steps"),
        (
            CommitBounds(10, 25, target_steps=0),
            10**12,
            f"/ckpt/job/step_{10**12:08d}",
            "has reported step 25",
        ),
        # At or below what is recorded: a replay after a reconnect, not refused (and
        # not recorded again).
        (BOUNDS, 10, "/ckpt/job/step_00000010", ""),
        (BOUNDS, 7, "/ckpt/job/step_00000007", ""),
        # Anything but the step's committed path in the job's directory.
        (BOUNDS, 20, "/ckpt/job/step_00000021", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/job/step_20", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/job/.step_00000020.g4.tmp", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/job/step_00000020/x", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/job/../other/step_00000020", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/jobs/step_00000020", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/job", "not at its committed path"),
        (BOUNDS, 20, "ckpt/job/step_00000020", "not at its committed path"),
        (BOUNDS, 20, "/ckpt/job/step_00000020\0", "not at its committed path"),
        (BOUNDS, 20, "/tmp/evil", "not at its committed path /ckpt/job/step_00000020"),
        # A replay's step does not excuse its path.
        (BOUNDS, 7, "/tmp/step_00000007", "not at its committed path"),
        (BOUNDS, 0, "/ckpt/job/step_00000000", "steps count from 1"),
    ],
)
def test_a_commit_is_the_committed_path_of_a_step_the_job_has_reached(bounds, step, path, refused):
    got = checkpoint_refusal(node((0,)), bounds, step, path)
    assert (refused in got) if refused else got == "", got


def test_a_job_without_a_checkpoint_directory_records_no_commit():
    assert "nowhere (the job has no checkpoint_dir)" in checkpoint_refusal(
        node((0,), directory=""), BOUNDS, 20, "/ckpt/job/step_00000020"
    )


def test_the_committed_path_is_the_one_the_trainer_reports():
    # trainer.checkpoint reports os.path.abspath(committed_path(checkpoint_dir, step)).
    for directory, step in (("/ckpt/job", 7), ("/ckpt/job/", 10**12), ("/a//b/./c", 1)):
        reported = os.path.abspath(checkpoint_dir.committed_path(directory, step))
        assert committed_path(directory, step) == reported
        bounds = CommitBounds(recorded_step=0, reported_step=step, target_steps=0)
        assert checkpoint_refusal(node((0,), directory), bounds, step, reported) == ""


@pytest.mark.parametrize(
    "kind, generation, ranks, suspect, refused",
    [
        (CheckpointProblemKind.QUARANTINED, 4, (0, 1), "", ""),
        (CheckpointProblemKind.UNREACHABLE, 4, (0,), "", ""),
        (CheckpointProblemKind.FENCE_TIMEOUT, 4, (0,), "node-7", ""),
        # Not rank 0's node, or an earlier generation's rank 0.
        (CheckpointProblemKind.QUARANTINED, 4, (2, 3), "", "does not host rank 0"),
        (CheckpointProblemKind.UNREACHABLE, 4, (2, 3), "", "does not host rank 0"),
        (CheckpointProblemKind.FENCE_TIMEOUT, 4, (2,), "node-7", "does not host rank 0"),
        (CheckpointProblemKind.UNREACHABLE, 3, (0,), "", "problem of generation 3"),
        (CheckpointProblemKind.FOREIGN_LINEAGE, 4, (0,), "", ""),
        (CheckpointProblemKind.FOREIGN_LINEAGE, 4, (1,), "", "does not host rank 0"),
        # A refused stale commit comes from a superseded generation's rank 0.
        (CheckpointProblemKind.STALE_COMMIT, 3, (2, 3), "", ""),
        (CheckpointProblemKind.FENCE_TIMEOUT, 4, (0,), "not a node!", "which is no node name"),
    ],
)
def test_problems_that_quarantine_or_suspect_come_from_the_current_rank_0(
    kind, generation, ranks, suspect, refused
):
    got = problem_refusal(node(ranks), kind, generation, suspect)
    assert (refused in got) if refused else got == "", got
