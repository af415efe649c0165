"""Squaring what a (re)connecting agent runs with the plan: a pure decision.

An agent's Hello says which generation of which job it runs (even when all its ranks
there have exited) and which of its ranks are alive. Ranks of the job's running
generation are adopted; anything else it runs is stopped cleanly; ranks planned on the
node that the agent does not know of died with a previous agent (or never started),
which ends their generation. A job still starting on the node is sent its rendezvous
request again: it may have been lost with the previous stream.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.policy.lifecycle import JobState


class Account(str, enum.Enum):
    ADOPT = "ADOPT"  # its ranks are the running generation's: keep them
    STOP_STALE = "STOP_STALE"  # it runs a generation that is not current: stop it
    RESEND_RENDEZVOUS = "RESEND_RENDEZVOUS"  # ask it again for the rendezvous port
    STOPPED = "STOPPED"  # nothing of the stopping generation runs there
    VANISHED = "VANISHED"  # ranks planned there died with its predecessor


@dataclass(frozen=True)
class AgentRuns:
    """What a Hello says the node runs."""

    node: str
    pid: int
    job: str = ""  # "" when it runs nothing
    generation: int = 0
    live_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class JobOnNode:
    """What the plan of a job says about one node."""

    job: str
    state: JobState
    generation: int
    on_node: bool  # the current generation is placed on the node
    first_node: bool  # ... and rank 0 is there
    rendezvous_known: bool
    planned_ranks: tuple[int, ...]  # the generation's ranks on the node
    exited_ranks: frozenset[int]
    vanished: bool  # the node is already counted as vanished
    placed_agent: int = 0  # the pid of the agent the ranks were planned for


@dataclass(frozen=True)
class AccountDecision:
    action: Account
    job: str
    reason: str
    generation: int = 0
    ranks: tuple[int, ...] = ()


def account(runs: AgentRuns, jobs: Iterable[JobOnNode]) -> list[AccountDecision]:
    """What to do about each job the Hello of ``runs.node`` concerns, in order."""
    decisions = []
    running_it = None
    for job in jobs:
        if job.job == runs.job:
            running_it = job
        if not job.on_node:
            continue
        if job.state is JobState.STARTING and not job.rendezvous_known and job.first_node:
            decisions.append(
                AccountDecision(
                    Account.RESEND_RENDEZVOUS,
                    job.job,
                    "the request may have been lost with the previous stream",
                    job.generation,
                )
            )
        if job.state not in (JobState.RUNNING, JobState.STOPPING) or (
            runs.job == job.job and runs.generation == job.generation
        ):
            continue
        missing = tuple(r for r in job.planned_ranks if r not in job.exited_ranks)
        # The incarnation the ranks were planned for may just not have got their start
        # (convergence gives it again); another one means they died with its
        # predecessor: so it is told even when the generation is already stopping (a
        # peer's crash, which the agent's death caused, reached the controller first).
        vanished = bool(missing) and not job.vanished and runs.pid != job.placed_agent
        if job.state is JobState.STOPPING:
            decisions.append(
                AccountDecision(
                    Account.STOPPED,
                    job.job,
                    f"{runs.node} runs nothing of generation {job.generation}",
                    job.generation,
                )
            )
            if not vanished:
                continue
        if vanished:
            decisions.append(
                AccountDecision(
                    Account.VANISHED,
                    job.job,
                    f"the agent of {runs.node} (pid {runs.pid}) came back without rank(s) "
                    f"{', '.join(map(str, missing))} of generation {job.generation}: they died "
                    f"with its previous incarnation",
                    job.generation,
                    missing,
                )
            )
    if not runs.job:
        return decisions
    current = (
        running_it is not None
        and running_it.state is JobState.RUNNING
        and running_it.generation == runs.generation
        and running_it.on_node
    )
    if current:
        decisions.append(
            AccountDecision(
                Account.ADOPT,
                runs.job,
                "the job's running generation",
                runs.generation,
                runs.live_ranks,
            )
        )
    else:
        decisions.append(
            AccountDecision(
                Account.STOP_STALE, runs.job, "not the job's running generation", runs.generation
            )
        )
    return decisions
