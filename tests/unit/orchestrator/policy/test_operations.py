"""Operations on a running job (replace, exclude, drain, stop), from states built by hand."""

import pytest

from orchestrator.policy.operations import (
    CHECKPOINT_WAIT_S,
    Change,
    Operation,
    ensure,
    ready,
    replace_problem,
    target,
    without_node,
)

REPLACE = Operation(
    node="b", reason="operator: replace b with c", policy="replace", generation=3, with_node="c"
)


@pytest.mark.parametrize(
    "pending, stop, now_, draining, change, reason, policy",
    [
        # Nothing asked: nothing to do.
        (None, "", False, (), Change.NONE, "", None),
        # An operator's stop begins a stop, checkpoint first unless --now ...
        (
            None,
            "stopped by the operator",
            False,
            (),
            Change.BEGIN,
            "stopped by the operator",
            "stop",
        ),
        # ... and takes over from a drain under way.
        (
            Operation("b", "drain b", "drain", 3).begin(10, 1.0),
            "stopped by the operator",
            True,
            ("b",),
            Change.BEGIN,
            "stopped by the operator",
            "stop",
        ),
        # A stop under way stays.
        (
            Operation("", "stopped", "stop", 3).begin(10, 1.0),
            "stopped",
            False,
            (),
            Change.NONE,
            "",
            None,
        ),
        # A node being drained gets a drain, of the first of them by name.
        (None, "", False, ("a", "b"), Change.BEGIN, "drain a, b", "drain"),
        # A drain whose node was uncordoned is called off.
        (
            Operation("b", "drain b", "drain", 3).begin(10, 1.0),
            "",
            False,
            (),
            Change.CALL_OFF,
            "drain of b called off",
            None,
        ),
        # An operator's replacement, recorded but not begun (or restored after a failover), begins.
        (REPLACE, "", False, (), Change.BEGIN, "operator: replace b with c", "replace"),
        (REPLACE.begin(10, 1.0), "", False, (), Change.NONE, "", None),
    ],
)
def test_ensure_keeps_the_operation_the_state_calls_for_under_way(
    pending, stop, now_, draining, change, reason, policy
):
    decision = ensure(pending, 3, stop, now_, draining)
    assert (decision.change, decision.reason) == (change, reason)
    if policy:
        assert decision.operation.policy == policy and decision.operation.generation == 3
    if policy == "stop":
        assert decision.operation.checkpoint is not now_


def test_a_stop_now_asks_for_no_checkpoint():
    assert ensure(None, 1, "stopped", True, ()).operation.checkpoint is False


@pytest.mark.parametrize(
    "pending, checkpoint, now, expected",
    [
        (None, (12, 3), 5.0, ""),
        (REPLACE, (12, 3), 5.0, ""),  # not begun yet
        (REPLACE.begin(10, 1.0), None, 5.0, ""),  # waiting for its checkpoint
        (REPLACE.begin(10, 1.0), (10, 3), 5.0, ""),  # not after the step it was asked at
        (REPLACE.begin(10, 1.0), (12, 2), 5.0, ""),  # an older generation's
        (
            REPLACE.begin(10, 1.0),
            (12, 3),
            5.0,
            "operator: replace b with c after checkpoint at step 12",
        ),
        (
            REPLACE.begin(10, 1.0),
            (10, 3),
            1.0 + CHECKPOINT_WAIT_S + 0.1,
            "operator: replace b with c; "
            "no checkpoint within 60s, restoring the last committed one",
        ),
        (
            Operation("", "stopped by the operator", "stop", 3, checkpoint=False).begin(10, 1.0),
            None,
            1.0,
            "stopped by the operator, without a final checkpoint",
        ),
    ],
)
def test_an_operation_is_ready_once_its_checkpoint_is_committed(pending, checkpoint, now, expected):
    step, generation = checkpoint if checkpoint else (None, 0)
    assert ready(now, pending, step, generation, 3) == expected


def test_the_next_generation_goes_on_the_node_asked_for_or_anywhere_with_an_alert():
    free = {"a": 2, "c": 2, "d": 2}
    placed = target(REPLACE, free, False, frozenset({"a", "b"}), 4, 4, 2)
    assert (placed.free_slots, placed.shrink, placed.alert) == ({"a": 2, "c": 2}, False, "")
    gone = target(REPLACE, {"a": 2, "d": 2}, False, frozenset({"a", "b"}), 4, 4, 2)
    assert gone.free_slots == {"a": 2, "d": 2}
    assert (gone.alert, gone.alert_node) == (
        "c can no longer take b's place; placing on any free node",
        "b",
    )
    # An exclusion re-plans smaller, at most the ranks that are left.
    exclude = Operation("b", "exclude straggler b", "exclude", 3)
    assert target(exclude, free, False, frozenset({"a", "b"}), 4, 4, 2).shrink is True
    assert target(exclude, free, False, frozenset({"a", "b"}), 4, 4, 2).ceiling == 2
    # Not a planned stop: placed anywhere, shrinking only if the lifecycle said so.
    assert target(None, free, True, frozenset({"a", "b"}), 4, 4, 2) == target(
        None, free, True, frozenset(), 0, 4, 0
    )
    assert target(None, free, True, frozenset(), 0, 4, 0).shrink is True


@pytest.mark.parametrize(
    "with_node, spare, cordoned, problem",
    [
        ("", {"c": 2}, frozenset(), ""),
        (
            "",
            {"c": 1},
            frozenset(),
            "no free node can take b's 2 rank(s); add a node, or `keel drain b` to re-plan smaller",
        ),
        ("c", {"c": 2}, frozenset(), ""),
        ("a", {"c": 2}, frozenset(), "a cannot take b's place: it already runs job j"),
        (
            "c",
            {},
            frozenset({"c"}),
            "c cannot take b's place: it is cordoned (`keel uncordon` it first)",
        ),
        (
            "c",
            {},
            frozenset(),
            "c cannot take b's place: it is not free (disconnected or running another job)",
        ),
        (
            "c",
            {"c": 1},
            frozenset(),
            "c cannot take b's place: it has 1 slot(s) and b runs 2 rank(s)",
        ),
    ],
)
def test_a_replacement_is_refused_with_what_stands_in_its_way(with_node, spare, cordoned, problem):
    assert (
        replace_problem("b", with_node, "j", frozenset({"a", "b"}), 2, spare, cordoned) == problem
    )


def test_where_a_job_goes_without_a_node():
    assert without_node(2, {"c": 2}, 0) == "on free nodes (2 slot(s) free, 2 needed)"
    assert without_node(2, {}, 1).startswith("on a re-planned smaller layout")
    assert without_node(2, {}, 0).startswith("once 2 slot(s) are free")


def test_an_operation_survives_etcd_as_an_intent_not_as_progress():
    begun = REPLACE.begin(10, 1.0)
    restored = Operation.from_record(begun.record())
    assert restored == REPLACE and not restored.begun


def test_a_leaving_agent_drains_its_node_and_its_successor_takes_it_back():
    from common.records import CordonRecord
    from orchestrator.policy.operations import agent_cordon

    drained = CordonRecord(by="agent", drain=True, pid=10, reason="drained by its agent", at_unix=0)
    assert agent_cordon("SIGTERM", 10, None) == ("drain", "drained by its agent: SIGTERM")
    assert agent_cordon("SIGTERM", 10, drained) is None  # asked again: nothing new
    assert agent_cordon("", 10, drained) is None  # the same agent, back
    assert agent_cordon("", 11, drained)[0] == "lift"  # a new agent: the node is back
    operator = CordonRecord(by="operator", drain=True, reason="maintenance", at_unix=0)
    assert agent_cordon("", 11, operator) is None  # never an operator's
    assert agent_cordon("SIGTERM", 11, operator) is None  # already draining
