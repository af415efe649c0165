"""Desired against actual: what a node runs (its agent's status, sent when it changes,
at least every 10 s or 10 step batches, ``agent.link.status_refresh_s``, and after
every Hello) against what the plan says it should, and what to send until they agree.
A pure decision.

A message can be lost with a stream, and a controller can lose the reply to a write
that went through: then a job may be RUNNING with nothing started on a node, or
STOPPING with a node that never heard of the stop. The plan is the truth; the agent
is told again, at most every ``RESEND_S``, and only once a status it sent at least
``RESEND_S`` after the last fix still shows the fix missing: at a mass start on a busy
controller, statuses sent before the start arrive after it, and a resend on each of
them would feed the load that delayed them. (An agent sends its status when it
changes and at least every 10 s, or every 10 step batches in a large cluster, so a start
that truly went missing is sent again within about that.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from orchestrator.policy.lifecycle import JobState
from protos import keel_pb2

RESEND_S = 2.0


class Fix(str, enum.Enum):
    START = "START"  # send the generation's StartGeneration again
    STOP = "STOP"  # send StopGeneration for the generation the agent runs


@dataclass(frozen=True)
class NodeRuns:
    """An agent's latest status."""

    node: str
    pid: int  # of the agent incarnation the status came from
    job: str  # the generation it runs or stops; "" = none
    generation: int
    phase: int  # a keel_pb2.AgentPhase
    started_job: str  # the newest StartGeneration it was given
    started_generation: int
    received_at: float  # monotonic: when the controller got the status


@dataclass(frozen=True)
class PlanOnNode:
    """What one job's plan says of the node."""

    job: str
    state: JobState
    generation: int
    placed: bool  # the generation has ranks on the node
    placed_agent: int  # the pid of the agent its ranks were planned for
    confirmed_stopped: bool  # the node confirmed the generation stopped
    lost: bool  # counted lost, or its agent came back without its ranks


@dataclass(frozen=True)
class Fixing:
    fix: Fix
    job: str
    generation: int
    reason: str


def converge(
    now: float, runs: NodeRuns, plans: list[PlanOnNode], last_fix_at: float
) -> Fixing | None:
    """What to send ``runs.node`` so that it runs what the plans say, or None."""
    if last_fix_at and (now - last_fix_at < RESEND_S or runs.received_at < last_fix_at + RESEND_S):
        return None  # told just now, or not heard from since it could have acted
    # A generation that is not current goes first: a new one may not start beside it.
    if runs.job and runs.phase == keel_pb2.AGENT_PHASE_RUNNING:
        current = next((p for p in plans if p.job == runs.job), None)
        if (
            current is None
            or current.generation != runs.generation
            or not current.placed
            or current.state not in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)
        ):
            return Fixing(
                Fix.STOP,
                runs.job,
                runs.generation,
                f"{runs.node} runs generation {runs.generation} of {runs.job}, which "
                f"is not that job's generation there",
            )
    for plan in plans:
        if not plan.placed or plan.lost:
            continue
        started = (runs.started_job, runs.started_generation) == (plan.job, plan.generation)
        # Only the incarnation the ranks were planned for may still start them: a
        # restarted agent's ranks died with its predecessor (adoption ends that).
        if plan.state is JobState.RUNNING and not started and plan.placed_agent == runs.pid:
            return Fixing(
                Fix.START,
                plan.job,
                plan.generation,
                f"{runs.node} never got the start of generation {plan.generation}",
            )
        if (
            plan.state is JobState.STOPPING
            and not plan.confirmed_stopped
            and (runs.job, runs.generation) == (plan.job, plan.generation)
            and runs.phase == keel_pb2.AGENT_PHASE_RUNNING
        ):
            return Fixing(
                Fix.STOP,
                plan.job,
                plan.generation,
                f"{runs.node} still runs generation {plan.generation}, which is being stopped",
            )
    return None


def still_unsettled(fixed: bool, since_fix_s: float, accounted: bool, cordon_due: bool) -> bool:
    """Whether a node is looked at again next tick rather than only when it says
    something new: it was just told what to run (``fixed``, or ``since_fix_s`` within
    RESEND_S, while the fix may still be on its way), its Hello is not squared with the
    plan yet (not ``accounted``), or its agent's drain cordon is still to be set or
    lifted (``cordon_due``)."""
    return fixed or since_fix_s < RESEND_S or not accounted or cordon_due
