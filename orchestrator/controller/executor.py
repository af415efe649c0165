"""Applying decisions: the only code that changes a job's state in etcd and in memory,
records events, and sends the agents what to do. Each method carries out one
decision of ``orchestrator.policy``; none decides anything itself. Called with the
state lock held, from the reconcile thread."""

from __future__ import annotations

import re
import time
from collections import Counter

import structlog

from common import env
from common.deadlines import DeadlineError
from common.epoch import next_generation
from common.records import CordonRecord, EventRecord, JobSpecRecord, PlanRecord
from orchestrator.controller import observe
from orchestrator.controller.checkpoint_records import CheckpointRecords
from orchestrator.controller.errors import Terminal
from orchestrator.controller.job_health import SlowFlag
from orchestrator.controller.job_runtime import MAX_FAILURES, JobRuntime
from orchestrator.controller.plans import plan_record
from orchestrator.controller.recovery import Recovery
from orchestrator.controller.sessions import agent_deadlines
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.controller.store import Deposed
from orchestrator.planner.sizing import size_and_layout
from orchestrator.policy import memory_snapshots, operations
from orchestrator.policy.adoption import Account, AccountDecision
from orchestrator.policy.convergence import Fix, Fixing
from orchestrator.policy.event_kind import WIRE_EVENT_KINDS, EventKind
from orchestrator.policy.generation import nodes_left, restore_point, unrestorable
from orchestrator.policy.guardrails import repeated_failures
from orchestrator.policy.job import Action, Decision
from orchestrator.policy.lifecycle import JobState, check_transition
from orchestrator.policy.offenders import NodeFailure, offenders
from orchestrator.policy.operations import Change, Operation, OperationDecision
from orchestrator.policy.placement import NodeRanks, place
from orchestrator.policy.remediation import Remedy, SlowNodeDecision
from orchestrator.policy.stop_deadline import Overdue
from orchestrator.spec.health import job_deadlines
from protos import keel_pb2

log = structlog.get_logger()

WAIT_LOG_S = 5.0  # a wait reason that only counts changes is logged this often at most
_DIGITS = re.compile(r"\d+")


class Executor:
    def __init__(self, state: ControllerState):
        self.state = state
        self.store = state.store
        self.records = CheckpointRecords(state)

    # ================================================================ lifecycle
    def transition(
        self,
        job: JobRuntime,
        target: JobState,
        reason: str,
        now: float,
        plan: PlanRecord | None = None,
        restore_step: int | None = None,
        **changes,
    ) -> None:
        """Persist the new state and ``changes`` (generation, restarts; the end time of
        a job that ends) in one revision-guarded write, and only then adopt them. A
        STARTING ``plan`` restores the checkpoint of ``restore_step`` (None: none)."""
        check_transition(job.state, target)
        previous = job.state
        wall = time.time()
        if target.terminal:
            changes["ended_at_unix"] = wall
        # The accounting moves with the state, in the same write.
        goodput = job.goodput.copy()
        goodput.on_state(
            wall,
            target,
            stop_requested=bool(job.intents.stop_requested),
            generation=changes.get("generation", job.generation),
            world_size=plan.world_size if plan else job.world_size,
            restore_step=restore_step,
        )
        state_seconds = dict(job.state_seconds)
        state_seconds[previous.value] = state_seconds.get(previous.value, 0.0) + max(
            0.0, wall - job.state_entered_at_unix
        )
        record = job.record().replace(
            **changes,
            goodput=goodput.record(),
            state_seconds=state_seconds,
            state_entered_at_unix=wall,
            state=target,
            reason=reason,
        )
        job.state_rev = self.store.update_job_state(job.name, record, job.state_rev, plan)
        for name, value in changes.items():
            setattr(job, name, value)
        job.goodput, job.state_seconds, job.state_entered_at_unix = goodput, state_seconds, wall
        job.state, job.reason, job.state_since_mono = target, reason, now
        self._track_recovery(job, target, wall)
        log.info(
            "job state",
            job=job.name,
            generation=job.generation,
            **{"from": previous.value, "to": target.value},
            reason=reason,
            restarts=job.restarts,
        )

    @staticmethod
    def _track_recovery(job: JobRuntime, target: JobState, wall: float) -> None:
        """Time the recovery under way: the old generation stopped (PENDING), the new
        one started (RUNNING); its first step completes it (``metrics.recovered``)."""
        recovery = job.recovery
        if recovery is None:
            return
        if target.terminal:
            job.recovery = None
        elif target is JobState.PENDING:
            if recovery.stopped_at_unix is None:
                recovery.stopped_at_unix = wall
        elif target is JobState.RUNNING:
            recovery.started_at_unix = wall

    def apply(self, job: JobRuntime, decision: Decision, now: float) -> None:
        """Carry out a lifecycle decision of ``policy.job.decide``."""
        if job.state is JobState.PENDING:
            job.goodput.waiting(
                time.time(), decision.action is Action.WAIT and decision.awaits_capacity
            )
        if decision.action is Action.WAIT:
            # A new reason is logged; one that differs only in its numbers (slots free
            # while a cluster connects, nodes still stopping) at most every WAIT_LOG_S.
            shape = _DIGITS.sub("#", decision.reason)
            if decision.reason != job.last_wait_reason and (
                shape != _DIGITS.sub("#", job.last_wait_reason)
                or now - job.last_wait_logged_mono >= WAIT_LOG_S
            ):
                job.last_wait_reason, job.last_wait_logged_mono = decision.reason, now
                log.info(
                    "waiting",
                    job=job.name,
                    generation=job.generation,
                    state=job.state.value,
                    reason=decision.reason,
                )
            return
        job.last_wait_reason = ""
        handler = {
            Action.PREPARE: self._prepare,
            Action.START: self._start,
            Action.STOP: self._stop,
            Action.RESTART: self._restart,
            Action.SUCCEED: self._finish,
            Action.FAIL: self._finish,
            Action.CANCEL: self._finish,
        }[decision.action]
        handler(job, decision, now)

    def fail(self, job: JobRuntime, reason: str, now: float) -> None:
        """End a job that cannot go on (a ``Terminal`` error)."""
        if job.state is JobState.PENDING:
            self.transition(job, JobState.FAILED, reason, now)
        else:
            log.error("job cannot go on", job=job.name, state=job.state.value, reason=reason)

    def _prepare(self, job: JobRuntime, decision: Decision, now: float) -> None:
        health = job.health
        avoid = observe.suspects(job) - frozenset(decision.use_suspects)
        planned = job.intents.operation if job.planned_stop else None
        target = operations.target(
            planned,
            observe.free_slots(self.state, job, avoid),
            decision.shrink,
            job.nodes,
            job.world_size,
            job.spec.world_size,
            job.ranks_on(planned.node) if planned and planned.node else 0,
        )
        if decision.alert:
            health.event(EventKind.ALERT, decision.alert, node=decision.use_suspects[0])
        if target.alert:
            health.event(EventKind.ALERT, target.alert, node=target.alert_node)
        try:
            world_size, mesh = size_and_layout(
                job.spec, target.free_slots, target.shrink, target.ceiling
            )
        except ValueError as exc:
            raise Terminal(f"no layout can run: {exc}") from None
        placement = place(world_size, target.free_slots)
        chain = self._deadlines(job, placement)
        reason = decision.reason
        if target.shrink:
            reason += f"; planner chose {mesh} at world size {world_size}"
        leaving = frozenset(job.lost_nodes) if decision.use_suspects else observe.suspects(job)
        records = self.store.checkpoints(job.name)
        restore = restore_point(records)
        lost = unrestorable(records)
        if lost and job.spec.on_no_checkpoint != keel_pb2.ON_NO_CHECKPOINT_FRESH_START:
            raise Terminal(
                f"{lost}. Nothing was started: a job that has checkpoints never starts "
                f"again from step 0 unless its spec says on_no_checkpoint = "
                f'"fresh_start"; or submit a new job with --resume-from one of them'
            )
        if lost:
            health.event(EventKind.FRESH_START, f"starting from step 0 as the spec allows: {lost}")
        snapshot = job.unrecorded_memory_snapshot or job.last_memory_snapshot
        alive = {node for node, session in self.state.sessions.items() if session.connected}
        memory = memory_snapshots.placed(
            snapshot, {p.node for p in placement}, alive, restore.step or 0
        )
        if memory.reason:
            reason += f"; {memory.reason}"
        if snapshot is not None and not memory.keep:
            log.info(
                "memory snapshot left behind",
                job=job.name,
                step=snapshot.step,
                nodes=sorted(set(snapshot.nodes) - {p.node for p in placement}),
                copy=memory.copy,
            )
            self.store.delete_memory_snapshot(job.name)
            job.last_memory_snapshot = job.unrecorded_memory_snapshot = None
        job.memory_copy = memory.copy
        job.replica_partners = {}
        job.repartner_after = 0.0
        plan = dict(
            generation=next_generation(job.generation, self.store.epoch),
            placement=placement,
            world_size=world_size,
            mesh=mesh,
            deadlines=chain,
            rendezvous=None,
            placed_agents={p.node: self.state.sessions[p.node].pid for p in placement},
            restore_from=restore.path,
            restore_fallbacks=list(restore.fallbacks),
        )
        self.transition(
            job,
            JobState.STARTING,
            reason,
            now,
            plan_record(job, **plan),
            restore_step=restore.step,
            generation=plan["generation"],
            planned_stop=False,
        )
        previous = job.nodes
        for name, value in plan.items():
            setattr(job, name, value)
        job.restore_step = restore.step
        left = nodes_left(previous, job.nodes, leaving, target.shrink, mesh, world_size)
        if left is not None:
            health.replacement_times.append(now)
            health.event(left.how, left.reason, node=left.out[0], step=job.progress.step)
        health.new_generation(job.generation, job.rank_nodes)
        job.remember_placement()
        job.placed_at_mono = now
        job.progress.node_step_times.clear()
        # The job is back at the step it restores: what an operation or a checkpoint
        # request of this generation waits to see passed.
        job.progress.step = restore.step or 0
        job.exits.clear()
        job.stopped_nodes.clear()
        job.lost_nodes.clear()
        job.vanished.clear()
        self._drop_intents(job)
        self.state.send(
            placement[0].node,
            keel_pb2.ControllerMessage(
                prepare_rendezvous=keel_pb2.PrepareRendezvous(
                    job=job.name, generation=job.generation
                )
            ),
        )

    def _deadlines(self, job: JobRuntime, placement: list[NodeRanks]) -> keel_pb2.Deadlines:
        """The job's deadline chain on this controller and the agents of ``placement``
        (their largest heartbeat, lease and reconnect back-off)."""
        config = self.state.config
        agents = [
            agent_deadlines(self.state.sessions[p.node].hello)
            for p in placement
            if p.node in self.state.sessions
        ]
        widest = {name: max(a[name] for a in agents) for name in agents[0]} if agents else {}
        try:
            chain = job_deadlines(
                job.health.spec,
                node_lost_grace_s=config.node_lost_grace_s,
                leader_ttl_s=config.leader_ttl_s,
                **widest,
            )
        except DeadlineError as exc:
            raise Terminal(f"the job's deadlines do not fit its nodes': {exc}") from None
        return keel_pb2.Deadlines(**vars(chain))

    def _start(self, job: JobRuntime, decision: Decision, now: float) -> None:
        job.deadlines = job.deadlines or self._deadlines(job, job.placement)
        reason = (
            f"generation {job.generation}: {job.world_size} ranks on "
            f"{len(job.placement)} nodes as {job.mesh}, "
            + (
                "fresh start"
                if not job.restore_from
                else f"restoring step {job.restore_step}"
                if job.restore_step is not None
                else f"restoring {job.restore_from}"
            )
        )
        # Now with the rendezvous endpoint: everything a new leader (or this one, after
        # a write whose reply it lost) needs to start this generation's ranks again.
        plan = plan_record(job)
        self.transition(job, JobState.RUNNING, reason, now, plan)
        for part in job.placement:
            self._send_start(job, part, now)
        self.records.announce(job)

    def _send_start(self, job: JobRuntime, part: NodeRanks, now: float) -> None:
        host, port = job.rendezvous
        start = keel_pb2.StartGeneration(
            job=job.name,
            generation=job.generation,
            world_size=job.world_size,
            local_world_size=part.local_world_size,
            master_addr=host,
            master_port=port,
            command=list(job.spec.command),
            env=dict(job.spec.env),
            restart_count=job.restarts,
            checkpoint_dir=job.spec.checkpoint_dir,
            restore_from=job.restore_from,
            job_id=job.job_id,
            # Another lineage's checkpoint starts the job only until it has its own.
            resume_from=job.spec.resume_from if not job.restore_from else "",
            mesh=job.mesh,
            health=job.health.spec,
            deadlines=job.deadlines,
            restore_fallbacks=job.restore_fallbacks,
            group_rank=job.group_rank(part),
            group_world_size=len(job.placement),
            max_restarts=job.spec.max_restarts,
            working_dir=job.spec.working_dir,
            cold_start=job.spec.cold_start,
        )
        self._memory_of(job, part.node, start)
        if job.health.spec.preflight_off:
            start.env[env.PREFLIGHT] = "0"
        for local_rank, rank in enumerate(part.ranks):
            start.ranks.append(keel_pb2.RankAssignment(rank=rank, local_rank=local_rank))
        self.state.send(part.node, keel_pb2.ControllerMessage(start_generation=start))
        self._fixed(part.node, now)

    def _memory_of(self, job: JobRuntime, node: str, start: keel_pb2.StartGeneration) -> None:
        """``start``'s memory tier fields for ``node``: the partner its snapshots are
        replicated to (chosen once a generation, ``policy.memory_snapshots.partner``:
        none across nodes), and the copy it brings into its memory before its ranks
        start (``policy.memory_snapshots.placed``: only onto a generation's one node)."""
        session = self.state.sessions.get(node)
        if session is None or not session.hello.peer_address:
            return  # it holds no memory for jobs
        if node not in job.replica_partners:
            job.replica_partners[node] = memory_snapshots.partner(
                node, self._memory_holders(), set(job.nodes), self._partner_load()
            )
        chosen = self.state.sessions.get(job.replica_partners[node])
        if chosen is not None:
            start.replica_node = chosen.node
            start.replica_address = chosen.hello.peer_address
        if job.memory_copy is not None:
            source, step, holder = job.memory_copy
            held = self.state.sessions.get(holder)
            if held is not None and held.hello.peer_address:
                start.memory_copy.CopyFrom(
                    keel_pb2.MemoryCopy(
                        node=source, step=step, holder=holder, address=held.hello.peer_address
                    )
                )

    def _memory_holders(self, now: float | None = None) -> dict[str, str]:
        """The nodes whose agents hold memory for jobs and are connected (and, given
        ``now``, still count: ``observe.node_usable``), with their failure domains."""
        return {
            name: s.hello.failure_domain
            for name, s in self.state.sessions.items()
            if s.connected
            and s.hello.peer_address
            and (now is None or observe.node_usable(self.state, name, now))
        }

    def _partner_load(self) -> Counter:
        """How many partnerships each node holds, over the jobs starting or running."""
        return Counter(
            partner
            for other in self.state.jobs.values()
            if other.state in (JobState.STARTING, JobState.RUNNING)
            for partner in other.replica_partners.values()
        )

    def _adopt_partner(self, job: JobRuntime, session: AgentSession) -> None:
        """Square the memory-snapshot partner ``session``'s Hello names for the running
        generation with the one this controller chose: a controller that took over
        learns it (and ``repartner`` replaces it when it is lost); an agent that missed
        its ``ReplicaPartner`` (sent as its stream went down) is told again."""
        node, said = session.node, session.hello.replica_node
        chosen = job.replica_partners.setdefault(node, said)
        partner = self.state.sessions.get(chosen)
        if chosen != said and partner is not None and partner.hello.peer_address:
            self._tell_partner(job, node, partner)

    def _tell_partner(self, job: JobRuntime, node: str, partner: AgentSession) -> None:
        self.state.send(
            node,
            keel_pb2.ControllerMessage(
                replica_partner=keel_pb2.ReplicaPartner(
                    job=job.name,
                    generation=job.generation,
                    node=partner.node,
                    address=partner.hello.peer_address,
                )
            ),
        )

    def repartner(self, job: JobRuntime, now: float) -> None:
        """Give a running generation's node whose memory-snapshot partner is lost (it
        no longer counts: ``observe.node_usable``) another one
        (``policy.memory_snapshots.repartnered``), and tell its agent, which copies
        its newest snapshot there at once. Costs a look at each partner a tick; the
        cluster is walked only when one is lost, and, while none other can take it, at
        most once a node-lost grace."""
        if now < job.repartner_after:
            return
        for node, current in job.replica_partners.items():
            if not current or observe.node_usable(self.state, current, now):
                continue
            chosen = memory_snapshots.repartnered(
                node, current, self._memory_holders(now), set(job.nodes), self._partner_load()
            )
            session = self.state.sessions.get(chosen)
            if session is None:
                job.repartner_after = now + self.state.config.node_lost_grace_s
                log.warning(
                    "memory snapshot partner lost; no other node holds memory to copy to",
                    job=job.name,
                    generation=job.generation,
                    node=node,
                    lost=current,
                )
                continue
            job.replica_partners[node] = chosen
            self._tell_partner(job, node, session)
            log.info(
                "memory snapshot partner lost; copying to another",
                job=job.name,
                generation=job.generation,
                node=node,
                lost=current,
                partner=chosen,
            )

    def _fixed(self, node: str, now: float) -> None:
        session = self.state.sessions.get(node)
        if session is not None:
            session.fixed_at = now

    def fix(self, session: AgentSession, fixing: Fixing, now: float) -> None:
        """Carry out ``convergence.converge``'s decision about ``session``'s node."""
        job = self.state.jobs.get(fixing.job)  # (the reconcile tick logs what it fixed)
        if fixing.fix is Fix.START:
            self._send_start(job, job.part_on(session.node), now)
            return
        session.send(
            keel_pb2.ControllerMessage(
                stop_generation=keel_pb2.StopGeneration(
                    job=fixing.job, generation=fixing.generation, reason=fixing.reason
                )
            )
        )
        session.fixed_at = now

    def _stop(self, job: JobRuntime, decision: Decision, now: float) -> None:
        cause = decision.root_cause
        if cause is not None:
            job.failures.append(
                keel_pb2.Failure(
                    generation=job.generation,
                    node=cause.node,
                    rank=cause.rank,
                    pid=cause.pid,
                    exit_code=cause.exit_code,
                    signal=cause.signal,
                    traceback=cause.traceback[-8000:],
                    stderr_tail=cause.stderr_tail[-4000:],
                    exited_at=cause.exited_at,
                    last_step=cause.last_step,
                )
            )
            del job.failures[:-MAX_FAILURES]
            job.health.event(
                EventKind.CRASH,
                decision.reason,
                node=cause.node,
                rank=cause.rank,
                step=cause.last_step,
                # From the process's exit (reaped within one agent tick of it) to the
                # controller knowing, traceback included.
                detected_after_s=max(0.0, cause.reported_at - (cause.reaped_at or cause.exited_at)),
                root_cause=cause.traceback[-8000:] or cause.stderr_tail[-2000:],
            )
        counts = dict(job.restarts_by_cause)
        if decision.cause:
            counts[decision.cause] = counts.get(decision.cause, 0) + 1
        if decision.replacement and job.intents.operation is not None:
            # The operation says which node the next generation moves off (and that it
            # is replaced): kept in etcd until then, for a leader that takes over
            # between this stop and the placement. A drain's is otherwise derived from
            # the cordons only while the job runs.
            self.store.put_operation(job.name, job.intents.operation.record())
        self.transition(
            job,
            JobState.STOPPING,
            decision.reason,
            now,
            planned_stop=decision.replacement,
            restarts_by_cause=counts,
        )
        if cause is not None and decision.cause == "crash" and not cause.parked:
            # (A parked rank says its generation failed under it: not its node's failure.)
            self._failed_on(job, cause.node, decision.reason)
        # A hang's culprit is named once every node's stacks are in: it is counted
        # against its node when the stop is done (``_restart``).
        job.health.hang_stopped = decision.cause == "hang"
        job.recovery = None
        if decision.cause:
            detected = job.state_entered_at_unix
            kind = {"agent_restart": "agent_restarted"}.get(decision.cause, decision.cause)
            fault = next(
                (
                    e
                    for e in reversed(job.health.events)
                    if WIRE_EVENT_KINDS.text(e.kind) == kind and e.generation == job.generation
                ),
                None,
            )
            job.recovery = Recovery(
                cause=decision.cause,
                detected_at_unix=detected,
                fault_at_unix=(
                    min(detected, fault.at - fault.detected_after_s)
                    if fault is not None
                    else detected
                ),
            )
        # Lost nodes too, if they are still connected: a node whose lease expired may
        # well be running.
        for node in job.nodes:
            self._fixed(node, now)
            self.state.send(
                node,
                keel_pb2.ControllerMessage(
                    stop_generation=keel_pb2.StopGeneration(
                        job=job.name,
                        generation=job.generation,
                        reason=decision.reason,
                        collect_stacks=decision.collect_stacks,
                    )
                ),
            )

    def _restart(self, job: JobRuntime, decision: Decision, now: float) -> None:
        if decision.replacement:
            # Planned: spends no restart; planned_stop stays set through PENDING, so the
            # next generation starts without a failure's back-off.
            self.transition(job, JobState.PENDING, decision.reason, now)
            return
        # A failure after a healthy stretch (or the job's first) restarts at once; each
        # one after it in a row waits longer (the back-off observe.observed gives).
        job.repeated_failures = repeated_failures(
            job.repeated_failures if job.placed_at_mono else 0, now - job.placed_at_mono
        )
        self.transition(job, JobState.PENDING, decision.reason, now, restarts=job.restarts + 1)
        health = job.health
        if health.hang_stopped and health.hung_node:
            hang = health.hang_event
            self._failed_on(
                job,
                health.hung_node,
                hang.reason + (f"; {hang.root_cause.splitlines()[0]}" if hang.root_cause else ""),
            )

    def _failed_on(self, job: JobRuntime, node: str, what: str) -> None:
        """Count a root-cause failure of the ending generation against ``node``; if it
        makes the node a repeat offender (``policy.offenders``), say so: the next
        placement stays off it (``observe.suspects``)."""
        health = job.health
        health.note_failure(NodeFailure(job.generation, node, what))
        for suspect in offenders(job.generation, health.node_failures):
            if suspect.node == node:
                health.event(EventKind.SUSPECTED, suspect.reason, node=node, step=job.progress.step)

    def _finish(self, job: JobRuntime, decision: Decision, now: float) -> None:
        target = {
            Action.SUCCEED: JobState.SUCCEEDED,
            Action.FAIL: JobState.FAILED,
            Action.CANCEL: JobState.CANCELLED,
        }[decision.action]
        self.transition(job, target, decision.reason, now)
        # Its snapshots' copies, wherever partners hold them (a partner chosen by an
        # earlier leader too): every connected agent drops what it holds of the job.
        release = keel_pb2.ControllerMessage(
            release_replicas=keel_pb2.ReleaseReplicas(job_id=job.job_id)
        )
        for session in self.state.sessions.values():
            if session.connected and session.hello.peer_address:
                session.send(release)

    def create(self, job: JobRuntime) -> bool:
        """Store a submitted job's spec and first state, then hold it here; False (and
        nothing changed) if etcd has a job of that name already."""
        revision = self.store.create_job(
            job.name, JobSpecRecord(spec=job.spec, job_id=job.job_id), job.record()
        )
        if not revision:
            return False
        job.state_rev = revision
        self.state.jobs[job.name] = job
        return True

    def request_stop(self, job: JobRuntime, reason: str, now: bool) -> None:
        """Record an operator's stop (``now``: without a final checkpoint) with the job's
        state in etcd first, then here; the lifecycle policy carries it out."""
        record = job.record().replace(stop_requested=reason, stop_now=now)
        job.state_rev = self.store.update_job_state(job.name, record, job.state_rev)
        job.intents.stop_requested, job.intents.stop_now = reason, now

    def forget(self, job: JobRuntime, why: str) -> None:
        """Delete an ended job's records from etcd (its checkpoints stay on disk)."""
        self.store.delete_job(job.name)
        del self.state.jobs[job.name]
        log.info("job deleted", job=job.name, state=job.state.value, reason=why)

    # ==================================================================== nodes
    def mark_lost(self, job: JobRuntime, node: str, down_for_s: float) -> None:
        job.lost_nodes.add(node)
        job.health.event(
            EventKind.NODE_LOST,
            f"{node}: agent stream down {down_for_s:.1f}s or its etcd lease expired",
            node=node,
            step=job.progress.step,
            detected_after_s=down_for_s,
        )

    def stop_overdue(self, job: JobRuntime, overdue: Overdue, deadline_s: float) -> None:
        """Carry out ``stop_deadline.overdue``'s finding: the node is declared failed for
        the generation (counted lost, so the job goes on without it) and cordoned, so
        that no new generation goes to a node whose processes SIGKILL cannot end. It
        is fenced as a lost node is: the generation's reports are refused from now on
        and the next generation claims the checkpoint directory's fence, and a process
        stuck in the kernel with a SIGKILL pending runs no more of its own code."""
        node = overdue.node
        job.lost_nodes.add(node)
        cordon = f"stopping generation {job.generation} of {job.name}: {overdue.reason}"
        if node in self.state.cordons:
            cordoned = f"already cordoned ({self.state.cordons[node].reason})"
        else:
            try:
                self.cordon(node, cordon, by="stop deadline", drain=False)
                cordoned = f"cordoned until `keel uncordon {node}`"
            except Deposed:
                raise
            except Exception as exc:
                cordoned = f"not cordoned (etcd did not take it: {exc})"
        job.health.event(
            EventKind.STOP_TIMEOUT,
            f"{node} {overdue.reason}; counted lost for generation {job.generation} past "
            f"the {deadline_s:g} s stop deadline, {cordoned}",
            node=node,
            step=job.progress.step,
            detected_after_s=deadline_s,
        )

    def flag_slow(self, job: JobRuntime, flag: SlowFlag, now: float) -> list[float]:
        """Record that ``flag.node`` was found slow; every flag time of it so far."""
        job.health.event(
            EventKind.STRAGGLER,
            flag.reason,
            node=flag.node,
            step=flag.step,
            detected_after_steps=flag.after_steps,
        )
        return job.health.note_flag(flag.node, now)

    def remedy(self, job: JobRuntime, node: str, decision: SlowNodeDecision, now: float) -> None:
        """Carry out ``remediation.slow_node``'s decision about ``node``."""
        if decision.cordon:
            try:
                self.cordon(node, decision.cordon, by="straggler detector", drain=False)
                job.health.event(
                    EventKind.CORDONED,
                    f"{node} {decision.cordon}; no new generation "
                    f"will be placed on it until `keel uncordon "
                    f"{node}`",
                    node=node,
                    step=job.progress.step,
                )
            except Deposed:
                raise
            except Exception as exc:
                job.health.event(
                    EventKind.ALERT,
                    f"could not cordon {node} ({decision.cordon}): {exc}",
                    node=node,
                )
        if decision.remedy is Remedy.ALERT:
            job.health.event(EventKind.ALERT, decision.reason, node=node, step=job.progress.step)
        elif decision.remedy in (Remedy.REPLACE, Remedy.EXCLUDE):
            self.begin(job, decision.operation, now, persist=True)

    def cordon(self, node: str, reason: str, by: str, drain: bool, pid: int = 0) -> CordonRecord:
        """Keep new generations off ``node`` (in etcd first, then here); ``pid``: the
        agent that drains its own node."""
        record = CordonRecord(reason=reason, by=by, drain=drain, at_unix=time.time(), pid=pid)
        self.store.cordon(node, record)
        self.state.cordons[node] = record
        log.info("node cordoned", node=node, reason=reason, by=by, drain=drain)
        self.state.wake.set()
        return record

    def uncordon(self, node: str, why: str) -> CordonRecord:
        """Let new generations go to ``node`` again (in etcd first); the cordon it had."""
        self.store.uncordon(node)
        was = self.state.cordons.pop(node)
        log.info("node uncordoned", node=node, was=was.reason, why=why)
        self.state.wake.set()
        return was

    def agent_cordon(self, session: AgentSession) -> None:
        """Carry out ``operations.agent_cordon`` for ``session``'s node."""
        change = operations.agent_cordon(
            session.leaving, session.pid, self.state.cordons.get(session.node)
        )
        if change is None:
            return
        what, reason = change
        if what == "drain":
            self.cordon(session.node, reason, by=operations.BY_AGENT, drain=True, pid=session.pid)
        else:
            self.uncordon(session.node, reason)

    # =============================================================== operations
    def operate(self, job: JobRuntime, decision: OperationDecision, now: float) -> None:
        """Carry out ``operations.ensure``'s decision."""
        if decision.change is Change.BEGIN:
            self.begin(job, decision.operation, now)
        elif decision.change is Change.CALL_OFF:
            # A checkpoint it asked for does no harm.
            node = job.intents.operation.node
            job.intents.operation = None
            job.health.event(EventKind.OPERATOR, decision.reason, node=node, step=job.progress.step)

    def begin(
        self, job: JobRuntime, operation: Operation, now: float, persist: bool = False
    ) -> None:
        """Start a checkpoint-then-stop: ask every rank for a checkpoint now (unless the
        operation skips it); the lifecycle policy stops the generation once it is
        committed. ``persist``: record it in etcd first (an operation that cannot be
        derived again from the cordons and the stop request)."""
        if persist:
            self.store.put_operation(job.name, operation.record())
        job.intents.operation = operation.begin(job.progress.step, now)
        if operation.checkpoint:
            self.request_checkpoint(job, operation.reason, job.intents.operation.after_step)
        self.state.wake.set()

    def request_checkpoint(self, job: JobRuntime, reason: str, after_step: int) -> None:
        """Ask every node of ``job`` for a checkpoint of a step after ``after_step``. The
        nodes hear it at different steps; a rank that hears it after a save of a later
        step began (one its peers started on hearing it first) knows it is met."""
        for part in job.placement:
            self.state.send(
                part.node,
                keel_pb2.ControllerMessage(
                    checkpoint_now=keel_pb2.CheckpointNow(
                        job=job.name,
                        generation=job.generation,
                        reason=reason,
                        after_step=after_step,
                    )
                ),
            )

    def pass_on_checkpoint_request(self, job: JobRuntime) -> None:
        """An operator's checkpoint request goes to the agents once per leadership, and
        is dropped once a checkpoint after its step is committed."""
        request = job.intents.checkpoint_request
        checkpoint = job.last_checkpoint
        if checkpoint is not None and operations.checkpoint_after(
            checkpoint.step, checkpoint.generation, request.after_step, request.generation
        ):
            self.store.delete_checkpoint_request(job.name)
            job.intents.checkpoint_request, job.intents.checkpoint_request_sent = None, False
        elif not job.intents.checkpoint_request_sent:
            self.request_checkpoint(job, request.reason, request.after_step)
            job.intents.checkpoint_request_sent = True

    def _drop_intents(self, job: JobRuntime) -> None:
        """A new generation: what was asked of the last one no longer applies."""
        if job.intents.operation is not None:
            self.store.delete_operation(job.name)
            job.intents.operation = None
        if job.intents.checkpoint_request is not None:
            self.store.delete_checkpoint_request(job.name)
            job.intents.checkpoint_request, job.intents.checkpoint_request_sent = None, False

    # ================================================================= adoption
    def account(self, session: AgentSession, decisions: list[AccountDecision]) -> None:
        """Carry out ``adoption.account``'s decisions about ``session``'s Hello."""
        for decision in decisions:
            job = self.state.jobs.get(decision.job)
            if decision.action is Account.RESEND_RENDEZVOUS:
                session.send(
                    keel_pb2.ControllerMessage(
                        prepare_rendezvous=keel_pb2.PrepareRendezvous(
                            job=decision.job, generation=decision.generation
                        )
                    )
                )
            elif decision.action is Account.STOPPED:
                job.stopped_nodes.add(session.node)
            elif decision.action is Account.VANISHED:
                job.vanished[session.node] = list(decision.ranks)
                job.health.event(
                    EventKind.AGENT_RESTARTED,
                    decision.reason,
                    node=session.node,
                    step=job.progress.step,
                )
            elif decision.action is Account.ADOPT:
                log.info(
                    "adopted running ranks",
                    job=decision.job,
                    node=session.node,
                    generation=decision.generation,
                    ranks=list(decision.ranks),
                )
                if job.last_checkpoint:
                    session.send(
                        keel_pb2.ControllerMessage(
                            checkpoint_recorded=keel_pb2.CheckpointRecorded(
                                job=job.name,
                                generation=job.generation,
                                step=job.last_checkpoint.step,
                            )
                        )
                    )
                self._adopt_partner(job, session)
            else:
                log.info(
                    "stopping stale ranks",
                    job=decision.job,
                    node=session.node,
                    generation=decision.generation,
                )
                session.send(
                    keel_pb2.ControllerMessage(
                        stop_generation=keel_pb2.StopGeneration(
                            job=decision.job, generation=decision.generation, reason=decision.reason
                        )
                    )
                )
        session.accounted = True

    # ============================================================ bookkeeping
    def store_initial_loss(self, job: JobRuntime) -> None:
        """Stored once, so a controller taking over reports the job's real start."""
        if job.progress.has_loss and not job.progress.initial_loss_stored:
            job.state_rev = self.store.update_job_state(job.name, job.record(), job.state_rev)
            job.progress.initial_loss_stored = True

    def save_events(self, job: JobRuntime) -> None:
        """Write the job's new and changed events to etcd, so the next leader shows
        them too; what etcd does not take now is tried again next tick."""
        health = job.health
        try:
            if health.dropped:
                self.store.delete_events(job.name, health.dropped)
                health.dropped = []
            unsaved = list(health.unsaved.items())
            if unsaved:
                # Hang stacks are bounded as they arrive (JobHealth.add_stacks).
                self.store.put_events(
                    job.name, [(seq, EventRecord(event=event)) for seq, event in unsaved]
                )
                for seq, event in unsaved:
                    if health.unsaved.get(seq) is event:
                        del health.unsaved[seq]
        except Deposed:
            raise
        except Exception as exc:
            log.warning("could not save events; will retry", job=job.name, error=str(exc))
