"""The small rules the controller's loop asks as it goes: the retry back-off of a
failed reconcile, whether a node is looked at again, whether a checkpoint meets a
request, and whether a rendezvous endpoint is the generation's."""

import pytest

from orchestrator.policy.authority import rendezvous_taken
from orchestrator.policy.convergence import RESEND_S, still_unsettled
from orchestrator.policy.guardrails import RETRY_FIRST_S, RETRY_MAX_S, reconcile_retry_s
from orchestrator.policy.operations import checkpoint_after


def test_a_failed_reconcile_is_retried_after_a_doubling_back_off_with_a_cap():
    waits, last = [], 0.0
    for _ in range(6):
        last = reconcile_retry_s(last)
        waits.append(last)
    assert waits == [RETRY_FIRST_S, 0.4, 0.8, 1.6, RETRY_MAX_S, RETRY_MAX_S]


@pytest.mark.parametrize(
    "fixed, since_fix_s, accounted, cordon_due, again",
    [
        (False, RESEND_S, True, False, False),  # agrees with the plan: only on news
        (True, RESEND_S, True, False, True),  # just told what to run
        (False, RESEND_S - 0.1, True, False, True),  # a fix may still be on its way
        (False, RESEND_S, False, False, True),  # its Hello is not squared yet
        (False, RESEND_S, True, True, True),  # its drain cordon is due
    ],
)
def test_a_node_is_looked_at_again_until_it_agrees(
    fixed, since_fix_s, accounted, cordon_due, again
):
    assert still_unsettled(fixed, since_fix_s, accounted, cordon_due) is again


@pytest.mark.parametrize(
    "step, generation, met",
    [(11, 3, True), (10, 3, False), (12, 2, False), (12, 4, False)],
)
def test_a_checkpoint_meets_a_request_when_it_is_later_and_of_that_generation(
    step, generation, met
):
    assert checkpoint_after(step, generation, after_step=10, of_generation=3) is met


@pytest.mark.parametrize(
    "starting, first, node, port, taken",
    [
        (True, "a", "a", 29500, True),
        (False, "a", "a", 29500, False),  # a late report: the job is past starting
        (True, "a", "b", 29500, False),  # not rank 0's node
        (True, "", "a", 29500, False),  # no placement
        (True, "a", "a", 0, False),
        (True, "a", "a", 65536, False),
    ],
)
def test_only_rank_0s_node_of_a_starting_job_sets_its_rendezvous(
    starting, first, node, port, taken
):
    assert rendezvous_taken(starting, first, node, port) is taken


def test_a_job_is_placed_on_free_nodes_at_most_its_ranks_per_node_each():
    from orchestrator.policy.placement import free_slots

    nodes = [("a", 8), ("b", 8), ("c", 4)]
    assert free_slots(nodes, set(), 0) == {"a": 8, "b": 8, "c": 4}
    assert free_slots(nodes, {"b"}, 0) == {"a": 8, "c": 4}
    assert free_slots(nodes, {"b"}, 6) == {"a": 6, "c": 4}
    assert free_slots([], set(), 2) == {}
