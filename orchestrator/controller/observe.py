"""Observing: the immutable views the policies decide on, read from the controller's
state without changing anything. Called with the state lock held."""

from __future__ import annotations

from common.deadlines import Deadlines, derived_stop_deadline_s
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.policy import (
    adoption,
    convergence,
    liveness,
    offenders,
    operations,
    placement,
    remediation,
    stop_deadline,
)
from orchestrator.policy.guardrails import restart_backoff_s
from orchestrator.policy.job import Observed, Spec
from orchestrator.policy.lifecycle import JobState


def node_usable(state: ControllerState, node: str, now: float) -> bool:
    """``liveness.node_usable`` of ``node``: registered in etcd, and its agent's stream
    up (or down for less than the node-lost grace; or, just after a takeover, not back
    yet); or, its record gone while its stream was up, for less than its lease TTL."""
    session = state.sessions.get(node)
    return liveness.node_usable(
        registered=node in state.registered,
        has_session=session is not None,
        connected=session is not None and session.connected,
        down_for_s=now - session.disconnected_at if session is not None else 0.0,
        grace_s=state.config.node_lost_grace_s,
        still_taking_over=liveness.taking_over(
            now - state.leader_since, now - state.agent_knocked_at, state.config.node_lost_grace_s
        ),
        since_leading_s=now - state.leader_since,
        unregistered_for_s=now - state.unregistered_at.get(node, float("-inf")),
        lease_ttl_s=session.hello.lease_ttl_s if session is not None else 0.0,
    )


def down_for(state: ControllerState, node: str, now: float) -> float:
    """Seconds the node's agent stream has been down (0 if it is up or never was)."""
    session = state.sessions.get(node)
    return now - session.disconnected_at if session and not session.connected else 0.0


def newly_lost(state: ControllerState, job: JobRuntime, now: float) -> list[str]:
    """Nodes of the job's generation that are no longer usable and not counted lost yet.
    Only those that may not be are judged (no record, no stream, or one that is down),
    found with set operations: a tick does not walk every node of a large job."""
    nodes = job.nodes - job.lost_nodes
    maybe = (
        (nodes - state.registered.keys()) | (nodes & state.down) | (nodes - state.sessions.keys())
    )
    return sorted(n for n in maybe if not node_usable(state, n, now))


def free_slots(
    state: ControllerState, job: JobRuntime, exclude: frozenset[str] = frozenset()
) -> dict[str, int]:
    """``placement.free_slots`` of the connected, registered nodes: the cordoned ones,
    those another job holds and ``exclude`` are busy."""
    busy = set(state.cordons) | exclude
    for other in state.jobs.values():
        if other is not job and other.state.holds_nodes:
            busy |= other.nodes
    connected = (
        (name, s.slots)
        for name, s in state.sessions.items()
        if s.connected and name in state.registered
    )
    return placement.free_slots(connected, busy, job.spec.ranks_per_node)


def spare_slots(state: ControllerState, job: JobRuntime) -> dict[str, int]:
    """Free slots on nodes the job does not run on now (nor should next)."""
    return {n: s for n, s in free_slots(state, job, suspects(job)).items() if n not in job.nodes}


def suspects(job: JobRuntime) -> frozenset[str]:
    """The nodes the job's next generation stays off if it can."""
    health = job.health
    return remediation.suspects(
        frozenset(job.lost_nodes),
        health.hung_node,
        job.intents.operation if job.planned_stop else None,
        frozenset(s.node for s in offenders.offenders(job.generation, health.node_failures))
        | health.suspected.keys(),
    )


def observed(state: ControllerState, job: JobRuntime, now: float) -> Observed:
    """The snapshot ``policy.job.decide`` judges the job's lifecycle on."""
    # Only a PENDING job is placed: the walk over every node for its free slots is
    # not made for a running one (a tick costs what changed, not the cluster's size).
    avoid = suspects(job) if job.state is JobState.PENDING else frozenset()
    free = free_slots(state, job) if job.state is JobState.PENDING else {}
    hang = job.health.hang_event
    hang_reason = (
        hang.reason + (f"; {hang.root_cause}" if hang.root_cause else "")
        if hang is not None and job.state is JobState.RUNNING
        else ""
    )
    checkpoint = job.last_checkpoint
    ready = (
        operations.ready(
            now,
            job.intents.operation,
            checkpoint.step if checkpoint else None,
            checkpoint.generation if checkpoint else 0,
            job.generation,
        )
        if job.state is JobState.RUNNING
        else ""
    )
    return Observed(
        state=job.state,
        state_since=job.state_since_mono,
        restarts=job.restarts,
        generation=job.generation,
        generation_world_size=job.world_size,
        free_slots={n: s for n, s in free.items() if n not in avoid},
        # Suspects that are connected and registered again, lost nodes that came back
        # among them: used only when nothing else can run the job.
        suspect_slots={n: s for n, s in free.items() if n in avoid},
        generation_nodes=job.nodes,
        rendezvous_ready=job.rendezvous is not None,
        exits=tuple(job.exits.values()),
        lost_nodes=frozenset(job.lost_nodes),
        vanished_nodes=frozenset(job.vanished),
        # state.down: the nodes whose agent's stream is down (a set kept as they go).
        unreachable_nodes=frozenset((job.nodes - job.lost_nodes) & state.down),
        stopped_nodes=frozenset(job.stopped_nodes),
        hang=hang_reason,
        replace=ready,
        replace_origin=job.intents.operation.origin if job.intents.operation else "operator",
        backoff_s=0.0 if job.planned_stop else restart_backoff_s(job.repeated_failures),
        stop_requested=job.intents.stop_requested,
        planned_stop=job.planned_stop,
        fatal=job.fatal,
    )


def stop_waiting(job: JobRuntime) -> frozenset[str]:
    """The nodes of a stopping generation that neither confirmed the stop nor are
    counted lost."""
    return job.nodes - job.lost_nodes - job.stopped_nodes


def stop_deadline_s(job: JobRuntime) -> float:
    """The generation's stop deadline (derived from its stop grace in a plan written
    before the chain had one)."""
    chain = job.deadlines
    if chain is None:
        return derived_stop_deadline_s(Deadlines.stop_grace_s)
    return chain.stop_deadline_s or derived_stop_deadline_s(chain.stop_grace_s)


def stuck(
    state: ControllerState, job: JobRuntime, nodes: frozenset[str]
) -> dict[str, tuple[stop_deadline.Stuck, ...]]:
    """The processes of ``job``'s generation that the agents of ``nodes`` found SIGKILL
    did not end (their latest status), by node; nodes with none are left out."""
    found = {}
    for node in nodes:
        session = state.sessions.get(node)
        status = session.status if session is not None else None
        if (
            status is not None
            and status.stuck
            and (status.job, status.generation) == (job.name, job.generation)
        ):
            found[node] = tuple(
                stop_deadline.Stuck(p.pid, p.rank, p.state, p.wchan) for p in status.stuck
            )
    return found


def spec(state: ControllerState, job: JobRuntime) -> Spec:
    return Spec(
        world_size=job.spec.world_size,
        max_restarts=job.spec.max_restarts,
        rendezvous_timeout_s=state.config.rendezvous_timeout_s,
        min_nodes=job.spec.min_nodes,
    )


def draining(state: ControllerState, job: JobRuntime) -> tuple[str, ...]:
    """The job's nodes that an operator is draining, sorted."""
    return tuple(
        sorted(n for n in job.nodes if (c := state.cordons.get(n)) is not None and c.drain)
    )


def node_runs(session: AgentSession) -> convergence.NodeRuns | None:
    """The agent's latest status, or None before its first."""
    status = session.status
    if status is None:
        return None
    return convergence.NodeRuns(
        node=session.node,
        pid=session.pid,
        job=status.job,
        generation=status.generation,
        phase=status.phase,
        started_job=status.started_job,
        started_generation=status.started_generation,
        received_at=session.status_at,
    )


def plans_on(state: ControllerState, node: str) -> list[convergence.PlanOnNode]:
    """What every job's plan says of ``node``."""
    return [
        convergence.PlanOnNode(
            job=job.name,
            state=job.state,
            generation=job.generation,
            placed=node in job.nodes,
            placed_agent=job.placed_agents.get(node, 0),
            confirmed_stopped=node in job.stopped_nodes,
            lost=node in job.lost_nodes or node in job.vanished,
        )
        for job in state.jobs.values()
    ]


def agent_runs(session: AgentSession) -> adoption.AgentRuns:
    """What the agent runs: its latest status, else its Hello."""
    said = session.status if session.status is not None else session.hello
    job, generation = (
        (said.job, said.generation)
        if session.status is not None
        else (said.running_job, said.running_generation)
    )
    return adoption.AgentRuns(
        node=session.node,
        pid=session.pid,
        job=job,
        generation=generation,
        live_ranks=tuple(r.rank for r in said.running),
    )


def job_on_node(job: JobRuntime, node: str) -> adoption.JobOnNode:
    return adoption.JobOnNode(
        job=job.name,
        state=job.state,
        generation=job.generation,
        on_node=node in job.nodes,
        first_node=bool(job.placement) and job.placement[0].node == node,
        rendezvous_known=job.rendezvous is not None,
        planned_ranks=tuple(sorted(job.ranks_on_node(node))),  # (indexed: no walk per Hello)
        exited_ranks=frozenset(job.exits),
        vanished=node in job.vanished,
        placed_agent=job.placed_agents.get(node, 0),
    )
