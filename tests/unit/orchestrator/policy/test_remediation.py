"""What the controller does about a slow node, and which nodes it stays off."""

import pytest

from orchestrator.policy.guardrails import HOUR_S
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.operations import Operation
from orchestrator.policy.remediation import (
    Remedy,
    SlowNode,
    StragglerPolicy,
    StragglerSpec,
    slow_node,
    suspects,
)

NOW = 10_000.0


def judge(
    policy="replace",
    flags=(NOW,),
    cordoned=False,
    under_way=False,
    state=JobState.RUNNING,
    replacements=(),
    per_hour=4,
):
    observed = SlowNode(
        node="b",
        job="j",
        state=state,
        generation=3,
        flag_times=flags,
        cordoned=cordoned,
        operation_under_way=under_way,
        replacement_times=replacements,
    )
    return slow_node(NOW, observed, StragglerSpec(StragglerPolicy(policy), per_hour))


@pytest.mark.parametrize(
    "kw, remedy, reason, cordon",
    [
        ({}, Remedy.REPLACE, "replace straggler b", ""),
        ({"policy": "exclude"}, Remedy.EXCLUDE, "exclude straggler b", ""),
        ({"policy": "alert"}, Remedy.NOTHING, "j's straggler policy is alert", ""),
        ({"under_way": True}, Remedy.NOTHING, "j is RUNNING with a move under way", ""),
        ({"state": JobState.STOPPING}, Remedy.NOTHING, "j is STOPPING", ""),
        (
            {"replacements": (NOW - 10,) * 4},
            Remedy.ALERT,
            "not replacing b: 4 replacements in the last hour already",
            "",
        ),
        # Replacements older than an hour no longer count.
        ({"replacements": (NOW - HOUR_S - 1,) * 4}, Remedy.REPLACE, "replace straggler b", ""),
        # Flagged twice within an hour: cordoned too, whatever else is done.
        (
            {"flags": (NOW - 60, NOW)},
            Remedy.REPLACE,
            "replace straggler b",
            "flagged slow twice within an hour in job j",
        ),
        (
            {"flags": (NOW - 60, NOW), "policy": "alert"},
            Remedy.NOTHING,
            "j's straggler policy is alert",
            "flagged slow twice within an hour in job j",
        ),
        ({"flags": (NOW - 60, NOW), "cordoned": True}, Remedy.REPLACE, "replace straggler b", ""),
        ({"flags": (NOW - HOUR_S - 1, NOW)}, Remedy.REPLACE, "replace straggler b", ""),
    ],
)
def test_a_slow_node_is_replaced_excluded_or_reported(kw, remedy, reason, cordon):
    decision = judge(**kw)
    assert (decision.remedy, decision.reason, decision.cordon) == (remedy, reason, cordon)
    if remedy in (Remedy.REPLACE, Remedy.EXCLUDE):
        assert decision.operation == Operation(
            node="b",
            reason=reason,
            policy=kw.get("policy", "replace"),
            generation=3,
            origin="straggler",
        )
    else:
        assert decision.operation is None


def test_the_next_generation_stays_off_lost_hung_and_moved_off_nodes():
    assert suspects(frozenset(), "", None) == frozenset()
    assert suspects(frozenset({"a"}), "b", Operation("c", "drain c", "drain")) == {"a", "b", "c"}
    # A job stop moves off no node.
    assert suspects(frozenset(), "", Operation("", "stopped", "stop")) == frozenset()
