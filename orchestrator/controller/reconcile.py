"""The reconcile loop: leadership, then, for every job, observe → decide → apply.

Each tick (every ``tick_s``, and at once when a handler records something) checks that
etcd answers and, under the state lock, squares each newly connected agent's Hello with
the plan, then converges each job on its spec and its operator's intents:

1. record what the agents reported (checkpoint commits in etcd, the first loss);
2. count the generation's nodes that are no longer usable as lost, and while stopping
   those that have not confirmed the stop within the stop deadline;
3. while running: judge each node found slow, and keep the operation the job's state
   calls for (a drain, a stop) under way, passing on an operator's checkpoint request;
4. decide the job's next lifecycle step and apply it.

and last squares what each node runs with the plans. Every decision is a pure function
of ``orchestrator.policy`` of a snapshot built by ``observe``; the ``Executor`` applies
it. Nothing here reacts to a single event: the next tick sees the whole state again.
What a tick costs grows with what changed, not with the cluster: the nodes it looks at
are those whose agent said something new (a Hello, a new status, leaving), whose record
came or went, or whose job's plan moved (``ControllerState.unsettled``), and all of them
every ``SWEEP_S``; the node records come from a watch, not a read per tick.
"""

from __future__ import annotations

import time

import structlog

from orchestrator.controller import exporter, metrics, observe
from orchestrator.controller.errors import Terminal
from orchestrator.controller.executor import Executor
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.leadership import Leadership
from orchestrator.controller.rebuild import carry_over, load_job
from orchestrator.controller.sessions import MAX_AGENTS
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.controller.store import Deposed, StaleRevision
from orchestrator.policy import (
    adoption,
    convergence,
    liveness,
    operations,
    pacing,
    remediation,
    retention,
    stop_deadline,
)
from orchestrator.policy.guardrails import reconcile_retry_s
from orchestrator.policy.job import decide
from orchestrator.policy.lifecycle import JobState, past_retention
from orchestrator.policy.straggler import evaluate
from protos import keel_pb2

log = structlog.get_logger()

SWEEP_S = 10.0  # every node is squared with the plan at least this often


class Reconciler:
    def __init__(self, state: ControllerState, leadership: Leadership, executor: Executor):
        self.state = state
        self.leadership = leadership
        self.executor = executor
        self.spent: dict[str, float] = {}  # this tick's seconds, by what took them
        # Per job, its plan's shape when last looked at, its placement and placed
        # agents then, and its nodes then (``_unsettle_moved_jobs``).
        self.shapes: dict[str, tuple[tuple, tuple, frozenset[str]]] = {}
        self.next_sweep = 0.0

    def loop(self, clock) -> None:
        """Run until the state's ``stopping`` is set; ``clock()`` gives monotonic seconds."""
        state = self.state
        next_refresh, etcd_down_since, next_hold = 0.0, 0.0, 0.0
        while not state.stopping.is_set():
            state.wake.wait(state.config.tick_s)
            state.wake.clear()
            if state.stopping.is_set():
                break
            now = clock()
            try:
                if not state.is_leader:
                    if now >= next_refresh:
                        next_refresh = now + state.config.leader_ttl_s / 4
                        self.leadership.campaign(now)
                    if not state.is_leader:
                        continue
                elif now >= next_refresh:
                    next_refresh = now + state.config.leader_ttl_s / 3
                    if not self.leadership.keep(now):
                        continue
                state.store.probe()
            except Exception as exc:
                if not etcd_down_since:
                    etcd_down_since = now
                    log.warning("etcd unreachable; retrying every tick", error=str(exc))
                # Renewed every third of a TTL while this controller still leads; once
                # it steps down (a TTL unrefreshed: a standby may lead by then) the
                # agents' holds run out within ``liveness.HOLD_TTLS`` more.
                if state.is_leader and now >= next_hold:
                    next_hold = now + state.config.leader_ttl_s / 3
                    self._hold_agents(now - etcd_down_since)
                continue
            if etcd_down_since:
                log.info("etcd reachable again", down_s=round(now - etcd_down_since, 2))
                etcd_down_since = 0.0
            self.tick(now)

    def score_loop(self) -> None:
        """Straggler scoring, off the state lock (``JobHealth.take_scoring``): a window
        of 32,000 ranks takes a moment to score, and agent messages, operator calls and
        ticks do not wait for it. Runs until the state's ``stopping`` is set."""
        state = self.state
        while not state.stopping.wait(state.config.tick_s):
            with state.lock:
                work = [
                    (job.name, job.health, job.health.take_scoring())
                    for job in state.jobs.values()
                    if job.state is JobState.RUNNING and job.health.scoring_due()
                ]
            for name, health, (epoch, scored, samples, config) in work:
                try:
                    result = evaluate(scored, samples, config)
                except Exception:
                    log.exception("straggler scoring failed; its samples are dropped", job=name)
                    continue
                with state.lock:
                    if health.settle_scoring(epoch, *result):
                        state.wake.set()

    def _hold_agents(self, down_s: float) -> None:
        """etcd is out of our reach too: an outage everyone sees, so agents that cannot
        renew their leases keep their ranks instead of fencing themselves, for
        ``liveness.etcd_hold_s`` from now."""
        hold_s = liveness.etcd_hold_s(self.state.config.leader_ttl_s)
        hold = keel_pb2.EtcdUnreachable(down_s=down_s, hold_s=hold_s)
        with self.state.lock:
            for session in self.state.sessions.values():
                if session.connected:
                    session.send(keel_pb2.ControllerMessage(etcd_unreachable=hold))

    def tick(self, now: float) -> None:
        """One pass over everything; a write that finds another controller leading
        ends it, and this leadership. A
        tick over its budget (a third of the leader TTL; the lease is kept alive apart
        from it) is one warning naming what took the time."""
        self.spent = {}
        began = time.monotonic()
        try:
            with metrics.RECONCILE_TICK.time():
                self._tick(now)
        except Deposed as exc:
            self.leadership.step_down(f"deposed: {exc}")
        took = time.monotonic() - began
        budget = self.state.config.leader_ttl_s / 3
        if took > budget:
            slowest = sorted(self.spent.items(), key=lambda item: -item[1])[:3]
            log.warning(
                "reconcile tick over its budget",
                took_s=round(took, 3),
                budget_s=budget,
                slowest=", ".join(f"{what} {seconds:.3f} s" for what, seconds in slowest),
            )

    def _spend(self, what: str, since: float) -> None:
        self.spent[what] = self.spent.get(what, 0.0) + time.monotonic() - since

    def _tick(self, now: float) -> None:
        state = self.state
        began = time.monotonic()
        with state.lock:
            self._spend("waiting for the state lock", began)
            began = time.monotonic()
            if now >= self.next_sweep:
                # Every node now and then, in case a change was missed.
                self.next_sweep = now + SWEEP_S
                self.forget_stale_sessions(now)
                state.unsettled.update(state.sessions)
            self._unsettle_moved_jobs()
            for node in list(state.unsettled):
                session = state.sessions.get(node)
                if session is None or not session.connected:
                    continue
                if not session.accounted:
                    jobs = [observe.job_on_node(job, session.node) for job in state.jobs.values()]
                    self.executor.account(
                        session, adoption.account(observe.agent_runs(session), jobs)
                    )
                self._guarded(self.executor.agent_cordon, session)
            self._pace()
            self._spend("agents' Hellos and cordons", began)
            wall = time.time()
            for job in list(state.jobs.values()):
                began = time.monotonic()
                if not job.state.terminal and now >= job.retry_at_mono:
                    before = job.state
                    self._attempt(job, now)
                    job = state.jobs[job.name]  # rebuilt from etcd, perhaps
                    if job.state is not before:
                        # The next step may be due at once (a stop confirmed: restart;
                        # restarted: place): no tick's wait between them.
                        state.wake.set()
                self.executor.save_events(job)
                if not job.records_pruned:  # just read from etcd: it may hold too many
                    self._guarded(self.executor.records.prune, job)
                if job.state in (JobState.PENDING, JobState.STOPPING):
                    job.goodput.commit_open(wall)
                if past_retention(
                    job.state, job.ended_at_unix, wall, state.config.finished_job_ttl_s
                ):
                    self._forget(job)
                self._spend(f"job {job.name}", began)
            began = time.monotonic()
            metrics.prune({job.name for job in exporter.exported(state, wall)})
            self._unsettle_moved_jobs()
            unsettled, state.unsettled = state.unsettled, set()
            fixes: list[tuple[str, convergence.Fixing]] = []
            for node in unsettled:
                session = state.sessions.get(node)
                runs = observe.node_runs(session) if session and session.connected else None
                if runs is None:
                    continue
                fixing = convergence.converge(
                    now, runs, observe.plans_on(state, node), session.fixed_at
                )
                if fixing is not None:
                    self.executor.fix(session, fixing, now)
                    fixes.append((node, fixing))
                if convergence.still_unsettled(
                    fixing is not None,
                    now - session.fixed_at,
                    session.accounted,
                    operations.agent_cordon(session.leaving, session.pid, state.cordons.get(node))
                    is not None,
                ):
                    state.unsettled.add(node)  # to be looked at again until it agrees
            _log_fixes(fixes)
            state.publish_reporting()
            self._spend("converging the nodes", began)

    def _pace(self) -> None:
        """Ask every agent to batch its step reports for longer (or less long) when the
        number of agents calls for it (``policy.pacing``; a new Hello is told in its
        Welcome). O(1) a tick, O(agents) on the few ticks it changes."""
        state = self.state
        interval = pacing.report_interval_s(
            state.streams, state.config.report_messages_per_s, state.report_interval_s
        )
        if interval == state.report_interval_s:
            return
        log.info(
            "asking the agents to batch their step reports",
            interval_s=interval,
            was_s=state.report_interval_s,
            agents=state.streams,
        )
        state.report_interval_s = interval
        for session in state.sessions.values():
            if session.connected:
                session.send(
                    keel_pb2.ControllerMessage(report_pace=keel_pb2.ReportPace(interval_s=interval))
                )

    def _end_overdue_stops(self, job: JobRuntime, now: float) -> None:
        """Count lost the nodes of a stopping generation past the stop deadline. The
        agents' statuses are looked through only once it has passed: on every tick of
        a stop, at 16,384 nodes, that would cost the tick for nothing."""
        deadline_s = observe.stop_deadline_s(job)
        if not stop_deadline.passed(now, job.state_since_mono, deadline_s):
            return
        waiting = observe.stop_waiting(job)
        stuck = observe.stuck(self.state, job, waiting)
        for overdue in stop_deadline.overdue(now, job.state_since_mono, deadline_s, waiting, stuck):
            self.executor.stop_overdue(job, overdue, deadline_s)

    def _unsettle_moved_jobs(self) -> None:
        """The nodes of a job whose plan moved (a new state, generation or placement,
        a node counted lost or confirmed stopped) are looked at this tick: what they
        should run changed. O(jobs): a new plan replaces a job's placement and placed
        agents whole, so they are compared by identity (the objects are held here, so
        a later one can never be taken for them), and within a generation its lost,
        stopped and vanished nodes only grow, so their sizes say whether they changed."""
        state = self.state
        for job in state.jobs.values():
            shape = (
                job.state,
                job.generation,
                len(job.lost_nodes),
                len(job.stopped_nodes),
                len(job.vanished),
            )
            plan = (job.placement, job.placed_agents)
            known = self.shapes.get(job.name)
            if (
                known is None
                or known[0] != shape
                or known[1][0] is not plan[0]
                or known[1][1] is not plan[1]
            ):
                state.unsettled.update(job.nodes)
                if known is not None:
                    state.unsettled.update(known[2])
                self.shapes[job.name] = (shape, plan, job.nodes)
        for name in [name for name in self.shapes if name not in state.jobs]:
            state.unsettled.update(self.shapes.pop(name)[2])

    def forget_stale_sessions(self, now: float) -> None:
        """Forget the sessions of agents down for long whose nodes no job's placement
        holds (``retention.sessions_to_forget``; under the lock)."""
        state = self.state
        held: set[str] = set()
        for job in state.jobs.values():
            held |= job.nodes
        down = [
            (node, session.disconnected_at)
            for node, session in state.sessions.items()
            if not session.connected and node not in held
        ]
        forgotten = retention.sessions_to_forget(now, down, retention.SESSION_KEPT_S, MAX_AGENTS)
        if forgotten:
            state.forget_sessions(forgotten)
            log.info(
                "forgot the sessions of agents down for long",
                nodes=len(forgotten),
                first=forgotten[0],
                kept_s=retention.SESSION_KEPT_S,
                sessions=len(state.sessions),
            )

    def _forget(self, job: JobRuntime) -> None:
        self._guarded(
            self.executor.forget,
            job,
            f"ended {job.state.value} more than {self.state.config.finished_job_ttl_s:g} s ago",
        )

    def _guarded(self, bookkeeping, subject: JobRuntime | AgentSession, *args) -> None:
        """Run ``bookkeeping(subject, *args)`` (a job's, or an agent's node's), a write
        that can wait: if etcd does not take it, it is tried again next tick."""
        try:
            bookkeeping(subject, *args)
        except Deposed:
            raise
        except Exception as exc:
            whose = (
                {"job": subject.name} if isinstance(subject, JobRuntime) else {"node": subject.node}
            )
            log.warning(
                "etcd did not take a write; will retry",
                **whose,
                write=bookkeeping.__name__,
                error=str(exc),
            )

    def _attempt(self, job: JobRuntime, now: float) -> None:
        """``reconcile`` the job, handling its failure by kind (see ``errors``). After
        any failure but a terminal one, what this controller holds of the job may differ
        from etcd (a write went through but its reply was lost, or the state moved
        under us): the job is rebuilt from etcd before it is reconciled again."""
        try:
            if job.rebuild:
                job = self._rebuild(job, now)
            self.reconcile(job, now)
        except Terminal as exc:
            self.executor.fail(job, str(exc), now)
        except StaleRevision as exc:
            log.error(
                "job state changed under us; rebuilding it from etcd", job=job.name, error=str(exc)
            )
            job.rebuild = True
        except Deposed:
            raise
        except Exception as exc:
            job.rebuild = True
            job.retry_backoff_s = reconcile_retry_s(job.retry_backoff_s)
            job.retry_at_mono = now + job.retry_backoff_s
            if job.retry_backoff_s == reconcile_retry_s(0):
                log.exception(
                    "reconcile failed; rebuilding from etcd after a back-off", job=job.name
                )
            else:
                log.warning(
                    "reconcile failed again",
                    job=job.name,
                    error=str(exc),
                    retry_in_s=job.retry_backoff_s,
                )
        else:
            job.retry_backoff_s, job.retry_at_mono = 0.0, 0.0

    def _rebuild(self, job: JobRuntime, now: float) -> JobRuntime:
        """The job as etcd has it, read with the code a new leader uses, with what only
        this controller knows carried over; its agents are asked to tell everything
        again (their Hellos are squared with the plan anew). Raises on etcd errors."""
        state = self.state
        fresh = load_job(state.store, job.name, now)
        if fresh is None:
            raise RuntimeError(f"job {job.name} is no longer in etcd")
        carry_over(job, fresh)
        state.jobs[job.name] = fresh
        for node in fresh.nodes:
            session = state.sessions.get(node)
            if session is not None and session.connected:
                session.accounted = False
                state.unsettled.add(node)
                session.send(keel_pb2.ControllerMessage(resync=keel_pb2.Resync()))
        log.info(
            "job rebuilt from etcd",
            job=fresh.name,
            state=fresh.state.value,
            generation=fresh.generation,
        )
        return fresh

    def reconcile(self, job: JobRuntime, now: float) -> None:
        state, executor = self.state, self.executor
        executor.records.record(job)
        executor.records.record_memory_snapshot(job)
        executor.records.problems(job)
        executor.store_initial_loss(job)
        for node in observe.newly_lost(state, job, now):
            executor.mark_lost(job, node, observe.down_for(state, node, now))
        if job.state is JobState.STOPPING:
            self._end_overdue_stops(job, now)
        if job.state is JobState.RUNNING:
            health = job.health
            for flag in health.slow_flags():
                times = executor.flag_slow(job, flag, now)
                executor.remedy(
                    job,
                    flag.node,
                    remediation.slow_node(
                        now,
                        remediation.SlowNode(
                            node=flag.node,
                            job=job.name,
                            state=job.state,
                            generation=job.generation,
                            flag_times=times,
                            cordoned=flag.node in state.cordons,
                            operation_under_way=job.intents.operation is not None,
                            replacement_times=health.replacement_times,
                        ),
                        remediation.StragglerSpec(
                            remediation.WIRE_STRAGGLER_POLICIES.from_wire(
                                health.spec.straggler_policy
                            ),
                            health.spec.max_replacements_per_hour,
                        ),
                    ),
                    now,
                )
            executor.operate(
                job,
                operations.ensure(
                    job.intents.operation,
                    job.generation,
                    job.intents.stop_requested,
                    job.intents.stop_now,
                    observe.draining(state, job),
                ),
                now,
            )
            if job.intents.checkpoint_request is not None:
                executor.pass_on_checkpoint_request(job)
            executor.repartner(job, now)
        decision = decide(now, observe.observed(state, job, now), observe.spec(state, job))
        executor.apply(job, decision, now)


FIXES_LOGGED = 5  # nodes a tick's convergence names one by one; past it, one line


def _log_fixes(fixes: list) -> None:
    """What a tick's convergence told nodes to do: a line per node for a few, else one
    line with the count per fix and the first nodes (a mass start or restart squares
    thousands at once, and a line for each would take most of the tick)."""
    if len(fixes) <= FIXES_LOGGED:
        for node, fixing in fixes:
            log.warning(
                "converging",
                node=node,
                job=fixing.job,
                generation=fixing.generation,
                fix=fixing.fix.value,
                reason=fixing.reason,
            )
        return
    counts: dict[str, int] = {}
    for _, fixing in fixes:
        counts[fixing.fix.value] = counts.get(fixing.fix.value, 0) + 1
    _, first = fixes[0]
    log.warning(
        "converging",
        nodes=len(fixes),
        fixes=counts,
        first_nodes=sorted(n for n, _ in fixes)[:FIXES_LOGGED],
        job=first.job,
        generation=first.generation,
        reason=first.reason,
    )
