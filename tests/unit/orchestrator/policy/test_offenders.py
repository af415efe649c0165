"""Repeat offenders (a node whose ranks failed in two generations in a row) and the nodes
checkpoint problems point at."""

import pytest

from common.wire_kinds import CheckpointProblemKind
from orchestrator.policy.offenders import (
    NodeFailure,
    Suspect,
    checkpoint_suspect,
    kept,
    offenders,
)
from protos import keel_pb2


def failed(generation, node, what="rank 0 exited with code 1"):
    return NodeFailure(generation, node, what)


@pytest.mark.parametrize(
    "ended, history, suspects",
    [
        # Nothing failed, or once only: no offender.
        (4, [], {}),
        (1, [failed(1, "n2")], {}),
        (4, [failed(4, "n2")], {}),
        # Twice in a row on one node.
        (
            4,
            [failed(3, "n2", "rank 1 exited with code 1"), failed(4, "n2", "rank 0 hung")],
            {
                "n2": "node n2's ranks failed in generations 3 and 4: rank 1 exited with "
                "code 1; rank 0 hung"
            },
        ),
        # Not in a row: generation 3 failed elsewhere (or not at all) in between.
        (4, [failed(2, "n2"), failed(3, "n1"), failed(4, "n2")], {}),
        (4, [failed(2, "n2"), failed(4, "n2")], {}),
        # The row must reach the generation that ended last: a generation that ran
        # healthy since (ended 5) lets the node back.
        (5, [failed(3, "n2"), failed(4, "n2")], {}),
        # Two nodes, each twice in a row (separate root causes), both suspected.
        (
            7,
            [failed(6, "a"), failed(6, "b"), failed(7, "b"), failed(7, "a")],
            {"a": "node a's ranks failed", "b": "node b's ranks failed"},
        ),
        # Two failures of one node in one generation count once.
        (4, [failed(4, "n2"), failed(4, "n2")], {}),
    ],
)
def test_a_node_whose_ranks_failed_twice_in_a_row_is_suspected(ended, history, suspects):
    found = offenders(ended, history)
    assert [s.node for s in found] == sorted(suspects)
    for suspect in found:
        assert suspect.reason.startswith(suspects[suspect.node]), suspect.reason


def test_only_the_failures_a_row_may_still_need_are_kept():
    history = [failed(g, "n2") for g in range(1, 6)]
    assert [f.generation for f in kept(5, history)] == [4, 5]
    assert offenders(5, kept(5, history)) == offenders(5, history)


def problem(suspect_node="", reason="it broke"):
    return keel_pb2.CheckpointProblem(
        step=30, path="/c/step_00000030", reason=reason, suspect_node=suspect_node
    )


@pytest.mark.parametrize(
    "kind, suspect_node, expected",
    [
        # Unreadable on the reporting node, or on the node it names (where a rank
        # verifying its share could not read it): that node's problem.
        (
            CheckpointProblemKind.UNREACHABLE,
            "",
            Suspect(
                "n1",
                "the checkpoint of step 30 could not be read on n1 (reported by n1; the "
                "checkpoint is left as it is): it broke",
            ),
        ),
        (CheckpointProblemKind.UNREACHABLE, "n4", Suspect("n4", "the checkpoint of step 30")),
        # The fence lock's holder: the node it names, else the reporter's own.
        (
            CheckpointProblemKind.FENCE_TIMEOUT,
            "n5",
            Suspect(
                "n5",
                "a process on n5 held the checkpoint directory's fence lock past its "
                "deadline (reported by n1): it broke",
            ),
        ),
        (CheckpointProblemKind.FENCE_TIMEOUT, "", Suspect("n1", "a process on n1 held")),
        # Problems of the checkpoint, or of the save, point at no node.
        (CheckpointProblemKind.QUARANTINED, "", None),
        (CheckpointProblemKind.STALE_COMMIT, "", None),
        (CheckpointProblemKind.SAVE_FAILED, "", None),
        (CheckpointProblemKind.FOREIGN_LINEAGE, "", None),
    ],
)
def test_a_checkpoint_problem_of_a_node_makes_it_a_suspect(kind, suspect_node, expected):
    got = checkpoint_suspect(kind, "n1", problem(suspect_node))
    if expected is None:
        assert got is None
    else:
        assert got.node == expected.node and got.reason.startswith(expected.reason), got
