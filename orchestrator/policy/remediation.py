"""What to do about a node that lets a job down: one flagged slow (a straggler, or far
below its peers in the preflight sweep), and which nodes the next generation stays off
(lost, hung, moved off on purpose, or suspected: ``policy.offenders``). Pure; times
are seconds on the caller's clock.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from common.proto_enums import ProtoEnum
from orchestrator.policy import guardrails
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.operations import Operation
from protos import keel_pb2


class StragglerPolicy(str, enum.Enum):
    """What is done with a node found persistently slow, as a spec file and ``keel up
    --straggler-policy`` spell it."""

    REPLACE = "replace"  # checkpoint, then a spare takes its ranks
    EXCLUDE = "exclude"  # checkpoint, then the job is re-planned without it
    ALERT = "alert"  # only report it


WIRE_STRAGGLER_POLICIES = ProtoEnum(StragglerPolicy, keel_pb2.StragglerPolicy, "STRAGGLER_POLICY_")


class Remedy(str, enum.Enum):
    NOTHING = "NOTHING"  # the policy is alert-only, or the job is busy with another move
    ALERT = "ALERT"  # a person should look; the reason says why nothing more is done
    REPLACE = "REPLACE"  # checkpoint, then the next generation runs with a spare instead
    EXCLUDE = "EXCLUDE"  # checkpoint, then the job is re-planned smaller without the node


@dataclass(frozen=True)
class SlowNodeDecision:
    remedy: Remedy
    reason: str
    cordon: str = ""  # also cordon the node cluster-wide, for this reason
    operation: Operation | None = None  # REPLACE, EXCLUDE: the checkpoint-then-stop


@dataclass(frozen=True)
class SlowNode:
    """What is known when ``node`` of ``job`` (in ``state``, at ``generation``) was
    just flagged slow. ``flag_times``: every flag of the node so far, this one
    included; ``replacement_times``: the job's replacements so far."""

    node: str
    job: str
    state: JobState
    generation: int
    flag_times: Sequence[float]
    cordoned: bool
    operation_under_way: bool
    replacement_times: Sequence[float]


@dataclass(frozen=True)
class StragglerSpec:
    """The job's straggler settings."""

    policy: StragglerPolicy
    max_replacements_per_hour: int


def slow_node(now: float, observed: SlowNode, spec: StragglerSpec) -> SlowNodeDecision:
    """What to do about ``observed.node``, just flagged slow."""
    node, job, state = observed.node, observed.job, observed.state
    policy, max_replacements_per_hour = spec.policy, spec.max_replacements_per_hour
    flag_times, replacement_times = observed.flag_times, observed.replacement_times
    operation_under_way = observed.operation_under_way
    cordon = ""
    if guardrails.should_cordon(flag_times, now) and not observed.cordoned:
        cordon = f"flagged slow twice within an hour in job {job}"
    if policy is StragglerPolicy.ALERT:
        return SlowNodeDecision(Remedy.NOTHING, f"{job}'s straggler policy is alert", cordon)
    if operation_under_way or state is not JobState.RUNNING:
        return SlowNodeDecision(
            Remedy.NOTHING,
            f"{job} is {state.value} with a move under way"
            if operation_under_way
            else f"{job} is {state.value}",
            cordon,
        )
    if not guardrails.replacement_allowed(replacement_times, now, max_replacements_per_hour):
        return SlowNodeDecision(
            Remedy.ALERT,
            f"not replacing {node}: "
            f"{max_replacements_per_hour} replacements in the last hour "
            f"already",
            cordon,
        )
    reason = f"{policy.value} straggler {node}"
    return SlowNodeDecision(
        Remedy.REPLACE if policy is StragglerPolicy.REPLACE else Remedy.EXCLUDE,
        reason,
        cordon,
        Operation(
            node=node,
            reason=reason,
            policy=policy.value,
            generation=observed.generation,
            origin="straggler",
        ),
    )


def suspects(
    lost: frozenset[str],
    hung: str,
    planned: Operation | None,
    named: frozenset[str] = frozenset(),
) -> frozenset[str]:
    """The nodes the next generation stays off, when it can: those lost from the
    generation that ended, the one whose rank hung (``hung``, "" if none), the one a
    planned stop moved the job off (``planned``), and ``named``: those suspected for
    what happened on them (``policy.offenders``: repeat offenders, nodes a checkpoint
    problem points at)."""
    found = set(lost) | named
    if hung:
        found.add(hung)
    if planned is not None and planned.node:
        found.add(planned.node)
    return frozenset(found)
