import pytest

from orchestrator.policy.lifecycle import IllegalTransition, JobState, check_transition
from orchestrator.policy.placement import NotEnoughSlots, place


def test_place_fills_nodes_in_order_with_contiguous_ranks():
    placed = place(4, {"node-1": 2, "node-0": 2})
    assert [(p.node, p.ranks) for p in placed] == [("node-0", (0, 1)), ("node-1", (2, 3))]
    assert [p.local_world_size for p in placed] == [2, 2]


def test_place_uses_the_fewest_nodes():
    placed = place(3, {"a": 1, "b": 4, "c": 2})
    assert [(p.node, p.ranks) for p in placed] == [("b", (0, 1, 2))]


def test_place_refuses_when_slots_are_short():
    with pytest.raises(NotEnoughSlots, match="3/4 slots free, need 4"):
        place(4, {"a": 2, "b": 1})


def test_lifecycle_allows_the_restart_loop():
    state = JobState.PENDING
    for target in (
        JobState.STARTING,
        JobState.RUNNING,
        JobState.STOPPING,
        JobState.PENDING,
        JobState.STARTING,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ):
        state = check_transition(state, target)
    assert state.terminal


@pytest.mark.parametrize(
    "current,target",
    [
        (JobState.PENDING, JobState.RUNNING),
        (JobState.RUNNING, JobState.PENDING),
        (JobState.SUCCEEDED, JobState.PENDING),
        (JobState.FAILED, JobState.STARTING),
    ],
)
def test_lifecycle_rejects_illegal_transitions(current, target):
    with pytest.raises(IllegalTransition, match=f"from {current.value} to {target.value}"):
        check_transition(current, target)
