"""What a node may report: only its own ranks, and checkpoints only from rank 0's
node, inside the job's checkpoint directory."""

from orchestrator.policy.authority import NodeAuthority, checkpoint_refusal, rank_refusal, within


def node(ranks=(2, 3), directory="/ckpt/job"):
    return NodeAuthority(
        node="b", generation=4, ranks=frozenset(ranks), commits=0 in ranks, checkpoint_dir=directory
    )


def test_a_node_speaks_only_for_its_own_ranks():
    assert rank_refusal(node(), 3) == ""
    assert rank_refusal(node(), 0) == (
        "b reported rank 0 of generation 4, which it does not host (its ranks: [2, 3])"
    )


def test_only_rank_zeros_node_records_a_commit():
    assert "rank 0 of generation 4 (the committing rank) is not on it" in checkpoint_refusal(
        node(), 10, "/ckpt/job/step_00000010"
    )
    assert checkpoint_refusal(node((0, 1)), 10, "/ckpt/job/step_00000010") == ""
    assert "steps count from 1" in checkpoint_refusal(node((0,)), 0, "/ckpt/job/step_0")


def test_a_checkpoint_must_lie_inside_the_jobs_directory():
    mine = node((0,))
    for path in (
        "/tmp/evil",
        "/ckpt/job/../other/step_00000010",
        "/ckpt/jobs/step_1",
        "/ckpt/job",
        "ckpt/job/step_1",
        "/ckpt/job/\0x",
    ):
        assert "outside the job's checkpoint directory /ckpt/job" in checkpoint_refusal(
            mine, 10, path
        ), path
    assert "nowhere (the job has no checkpoint_dir)" in checkpoint_refusal(
        node((0,), directory=""), 10, "/ckpt/job/step_1"
    )
    assert within("/ckpt/job/./step_00000010", "/ckpt/job/")
