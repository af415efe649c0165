"""Agent sessions: one ``Connect`` stream per agent, and what its messages say.

The streams live on the server's event loop (``grpc.aio``): a stream costs no thread,
and taking a message off it is O(1), a put on the queue of the one thread that records
agent messages (``_ingest``), which takes the state lock once per batch of them. A
batch of step reports is judged there first, without the lock (``_batch_refused``: too
large, of no job, of a generation the node is not part of), and a stream must open with
its Hello within ``deadlines.HELLO_TIMEOUT_S``: what a join token lets a caller make
the controller hold stays bounded (docs/architecture.md, "Bounds before trust"). A
handler there only records facts (a rank exited, a step was reported, a checkpoint
was committed, stacks of a hang arrived, a node is slow in preflight) and wakes the
reconcile loop, which decides what they mean.

A Hello costs two etcd calls (the agent's lease alive? its node record put on it), made
on a pool of ``ADMITTING`` threads, unless the agent reconnects on the lease its record
is already on (a failover: then none). Past ``ADMISSION_QUEUE`` Hellos waiting for them, a
Connect is refused at once with RESOURCE_EXHAUSTED: its agent backs off (jittered) and
tries again, so a whole cluster reconnecting is let in at the rate etcd takes it,
instead of timing out and reconnecting in waves.
"""

from __future__ import annotations

import asyncio
import collections
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from common import deadlines
from common.keys import NODE_NAME, NODE_NAME_RULE
from common.records import CheckpointRecord, MemorySnapshotRecord, NodeRecord, RecordError
from common.steps import MAX_BATCH_REPORTS
from common.wire_kinds import WIRE_HANG_PHASES, WIRE_PROBLEM_KINDS
from orchestrator.controller import metrics
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.job_runtime import RECENT_STEPS, JobRuntime
from orchestrator.controller.leadership import Leadership
from orchestrator.controller.state import AgentSession, ControllerState, LoopOutbox, LoopPost
from orchestrator.controller.store import Deposed
from orchestrator.policy import certificates, memory_snapshots
from orchestrator.policy.authority import (
    CommitBounds,
    NodeAuthority,
    batch_refusal,
    checkpoint_refusal,
    memory_snapshot_refusal,
    problem_refusal,
    rank_refusal,
    rendezvous_taken,
)
from orchestrator.policy.event_kind import EventKind
from orchestrator.policy.job import RankExit
from orchestrator.policy.lifecycle import JobState
from orchestrator.security.auth import Presented, presented_certificate
from orchestrator.spec.jobspec import MAX_SLOTS
from protos import keel_pb2

log = structlog.get_logger()

MAX_AGENTS = 16384  # agents one controller serves (see benchmarks.control_plane)
OPERATOR_THREADS = 64  # threads for the operators' calls
ADMITTING = 8  # Hellos checked against etcd at once
ADMISSION_QUEUE = 256  # Hellos waiting for that, past which Connect is refused
INGEST_BATCH = 1024  # agent messages recorded per hold of the state lock, at most
# After the first message of a batch, how long the recorder lets more gather: at
# thousands of agents, a batch a message costs a thread wake-up and a pass of the GIL
# each (docs/BENCHMARKS.md, control_plane); a few milliseconds' delay is nothing to
# what an agent message asks of the controller.
INGEST_GATHER_S = 0.005


class AgentService:
    def __init__(self, state: ControllerState, leadership: Leadership):
        self.state = state
        self.leadership = leadership
        # What each kind of agent message records (``_record``): one handler a kind.
        self._handlers = {
            kind.name: getattr(self, f"_on_{kind.name}")
            for kind in keel_pb2.AgentMessage.DESCRIPTOR.oneofs_by_name["kind"].fields
        }
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (session, message | None)
        self._post: LoopPost | None = None  # to the streams' outboxes (_post_on)
        self.admitting = ThreadPoolExecutor(ADMITTING, thread_name_prefix="admit")
        self.waiting = 0  # Hellos being admitted or waiting to be (on the loop only)
        self.refused = 0  # Connects refused for want of room in the admission queue
        threading.Thread(target=self._ingest, name="agent-messages", daemon=True).start()

    # ================================================================== Connect
    async def connect(self, request_iterator, context):
        refusal = self.leadership.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        try:
            first = await asyncio.wait_for(context.read(), deadlines.HELLO_TIMEOUT_S)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no Hello within {deadlines.HELLO_TIMEOUT_S:g} s of opening the stream: "
                f"an agent's stream opens with its Hello",
            )
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "hello":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first message on an agent stream must be a Hello",
            )
        hello = first.hello
        problem = check_hello(hello)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        problem = deadline_misfit(hello, self.state.config)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        presented = presented_certificate(context.auth_context())
        if self.waiting >= ADMISSION_QUEUE:
            self.state.agent_knocked_at = time.monotonic()
            self.refused += 1
            metrics.AGENTS_DEFERRED.inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.waiting} agents are being admitted; back off and connect again",
            )
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            session, refusal = await loop.run_in_executor(
                self.admitting, self._admit, hello, presented, LoopOutbox(self._post_on(loop))
            )
        finally:
            self.waiting -= 1
        if refusal is not None:
            await context.abort(*refusal)
        self.state.agent_knocked_at = time.monotonic()
        log.info(
            "agent connected",
            node=hello.node,
            slots=hello.slots,
            host=hello.host,
            agents=self.state.connected(),
        )
        reader = asyncio.ensure_future(self._read(session, context))
        try:
            while True:
                message = await session.outbox.get()
                if message is None:
                    break
                await context.write(message)
        finally:
            reader.cancel()
            self.inbox.put((session, None))  # after every message it read

    def _admit(
        self, hello: keel_pb2.Hello, presented: Presented | None, outbox: LoopOutbox
    ) -> tuple[AgentSession | None, tuple[grpc.StatusCode, str] | None]:
        """Check the Hello's certificate (``presented``, None over plaintext) and lease
        and put its node record (on an admission thread); the new session, or why the
        Connect is refused."""
        state = self.state
        if presented is not None:
            refusal = self._certificate_refusal(hello.node, presented)
            if refusal is not None:
                return None, refusal
        with state.lock:
            current = state.sessions.get(hello.node)
            if state.streams >= MAX_AGENTS and not (current is not None and current.connected):
                return None, (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this controller serves at most {MAX_AGENTS} agents",
                )
        record = NodeRecord(
            host=hello.host, slots=hello.slots, pid=hello.pid, lease_id=hello.lease_id
        )
        with state.lock:
            # An agent reconnecting on the lease its record is on (after a failover, say):
            # the record is alive (it goes with its lease, and the watch says so), and
            # it is what it would be put as. No etcd call.
            known = state.registered.get(hello.node) == record
        try:
            lease_alive = known or state.store.lease_alive(hello.lease_id)
            if lease_alive and not known:
                state.store.put_node(hello.node, record, hello.lease_id)
        except Deposed as exc:
            self.leadership.step_down(str(exc))
            return None, (
                grpc.StatusCode.UNAVAILABLE,
                "this controller no longer leads; find the leader in etcd",
            )
        except Exception as exc:
            return None, (grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        if not lease_alive:
            return None, (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"etcd lease {hello.lease_id} of node {hello.node} is not alive; "
                f"grant a new lease and reconnect",
            )
        with state.lock:
            if not state.is_leader:  # since the check on entry
                return None, (
                    grpc.StatusCode.UNAVAILABLE,
                    "this controller stopped leading; find the leader in etcd",
                )
            session = AgentSession(
                node=hello.node,
                host=hello.host,
                slots=hello.slots,
                lease_id=hello.lease_id,
                pid=hello.pid,
                hello=hello,
                term=state.term or 0,
                epoch=state.epoch,
                outbox=outbox,
            )
            state.attach(session)
            # As put: the watch of the node records brings the same a moment later.
            state.registered[hello.node] = record
            session.send(
                keel_pb2.ControllerMessage(
                    welcome=keel_pb2.Welcome(
                        controller_id=state.id, report_interval_s=state.report_interval_s
                    )
                )
            )
        state.wake.set()  # the reconcile loop squares its Hello with the plan
        return session, None

    def _certificate_refusal(
        self, node: str, presented: Presented
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why the certificate ``presented`` may not say Hello for ``node``
        (``policy.certificates.hello_refusal``, with the node's certificate record read
        from etcd), or None. A record that does not parse refuses the node until an
        operator writes it anew: a node's identity is not guessed at."""
        try:
            record = self.state.store.certificate(node).value
        except RecordError as exc:
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"node {node}'s certificate record does not parse ({exc.problem}); "
                f"`keel certs revoke {node}` then `keel certs approve {node}` write it anew"
            )
        except Exception as exc:
            return grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}"
        problem = certificates.hello_refusal(
            node,
            record,
            presented.bound,
            presented.key_sha256,
            self.state.config.allow_shared_agent_certificate,
        )
        if problem:
            log.warning("agent refused", node=node, reason=problem)
            return grpc.StatusCode.PERMISSION_DENIED, problem
        return None

    def _post_on(self, loop: asyncio.AbstractEventLoop) -> LoopPost:
        """The one ``LoopPost`` of the server's loop (made on it, by its first stream)."""
        if self._post is None or self._post.loop is not loop:
            self._post = LoopPost(loop)
        return self._post

    async def _read(self, session: AgentSession, context) -> None:
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    break
                if message.WhichOneof("kind") == "steps" and self._batch_refused(
                    session, message.steps
                ):
                    continue
                self.inbox.put((session, message))
        except (grpc.RpcError, asyncio.CancelledError):
            pass  # the stream ended; the agent reconnects on its own
        finally:
            session.close()

    def _batch_refused(self, session: AgentSession, batch: keel_pb2.StepReportBatch) -> bool:
        """Whether a batch of step reports is refused on the server's loop, before it is
        queued for the recorder (which takes the state lock): one past
        ``MAX_BATCH_REPORTS``, for a job that does not exist, or for a generation the
        node is not part of (``authority.batch_refusal``, on the jobs as last
        published). Cheap: a length per entry, none of its fields parsed again."""
        entries = len(batch.node_steps)
        # Its ranks are counted only when its entries are within the bound.
        reports = (
            sum(len(entry.ranks) for entry in batch.node_steps)
            if entries <= MAX_BATCH_REPORTS
            else entries
        )
        refusal = batch_refusal(
            session.node,
            batch.job,
            batch.generation,
            entries,
            reports,
            self.state.reporting.get(batch.job),
            MAX_BATCH_REPORTS,
        )
        if refusal:
            # No log line per batch: a node that reports for a job deleted under it
            # would write one a second; the count and the first of a stream say it.
            metrics.AGENT_MESSAGES_REFUSED.labels(kind="steps").inc()
            if not session.batch_refused:
                session.batch_refused = True
                log.warning("refusing step reports", node=session.node, reason=refusal)
        return bool(refusal)

    def _ingest(self) -> None:
        """Record agent messages in arrival order, a batch per hold of the state lock
        (what arrived within ``INGEST_GATHER_S`` of the first)."""
        state = self.state
        while True:
            batch = [self.inbox.get()]
            time.sleep(INGEST_GATHER_S)
            while len(batch) < INGEST_BATCH:
                try:
                    batch.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            with state.lock:
                for session, message in batch:
                    if message is None:
                        self._disconnected(session)
                        continue
                    try:
                        self._record(session, message)
                    except Exception:
                        # A message we could not handle: end this stream (the agent
                        # reconnects and replays), never the controller.
                        log.exception("agent message failed; closing its stream", node=session.node)
                        session.close()

    def _disconnected(self, session: AgentSession) -> None:
        state = self.state
        was = session.connected
        state.detach(session, time.monotonic())
        session.close()
        if was:
            log.info("agent disconnected", node=session.node, agents=state.connected())
            state.wake.set()

    # ================================================================== facts
    def _job_for(self, job_name: str, generation: int) -> JobRuntime | None:
        """The job a report is about, if the report is for its current generation."""
        job = self.state.jobs.get(job_name)
        if job is None or generation != job.generation:
            return None
        return job

    @staticmethod
    def _refused(session: AgentSession, kind: str, refusal: str) -> bool:
        """Log and count a message the node may not send (``refusal`` says why); False
        if there is no refusal."""
        if refusal:
            log.warning("refusing an agent message", node=session.node, kind=kind, reason=refusal)
            metrics.AGENT_MESSAGES_REFUSED.labels(kind=kind).inc()
        return bool(refusal)

    def _record(self, session: AgentSession, message: keel_pb2.AgentMessage) -> None:
        """Record what ``message`` says: the handler of its kind (``self._handlers``)."""
        kind = message.WhichOneof("kind")
        if kind is not None:
            self._handlers[kind](session, getattr(message, kind))

    def _on_steps(self, session: AgentSession, body) -> None:
        """A node's steps (or their replay after a reconnect): the job's progress."""
        job = self._job_for(body.job, body.generation)
        if job is None:
            return  # (a batch of a job that does not exist was refused on the loop)
        mine = job.ranks_on_node(session.node)
        if body.replayed:
            reports, invalid, theirs = _checked_replay(body, mine)
        else:
            reports, invalid, theirs = _checked_steps(body, mine)
        if invalid:
            log.warning(
                "ignoring step reports numbered below 1 or with a step time "
                "that is not a finite number of seconds",
                node=session.node,
                count=invalid,
            )
        if theirs is not None:
            self._refused(session, "steps", rank_refusal(authority(job, session.node), theirs))
        if body.replayed:
            _progress(job, reports)
        else:
            _steps(job, body.generation, session.node, reports)

    def _on_status(self, session: AgentSession, body) -> None:
        """The agent's status: the reconcile loop squares a changed one with the plan."""
        if session.status != body:
            self.state.unsettled.add(session.node)
        session.status, session.status_at = body, time.monotonic()

    def _on_rendezvous_ready(self, session: AgentSession, body) -> None:
        """Rank 0's node bound the rendezvous endpoint."""
        job = self._job_for(body.job, body.generation)
        if job and rendezvous_taken(
            job.state is JobState.STARTING,
            job.placement[0].node if job.placement else "",
            session.node,
            body.port,
        ):
            job.rendezvous = (body.host, body.port)
            self.state.wake.set()

    def _on_rank_exited(self, session: AgentSession, body) -> None:
        """A rank exited: kept for the lifecycle policy, which names the root cause."""
        job = self._job_for(body.job, body.generation)
        if job is None or self._refused(
            session, "rank_exited", rank_refusal(authority(job, session.node), body.rank)
        ):
            return
        job.exits[body.rank] = RankExit(
            node=session.node,
            rank=body.rank,
            pid=body.pid,
            exit_code=body.exit_code,
            signal=body.signal,
            exited_at=body.exited_at,
            stopped_by_agent=body.stopped_by_agent,
            traceback=body.traceback,
            stderr_tail=body.stderr_tail,
            last_step=body.last_step,
            reported_at=time.time(),
            reaped_at=body.reaped_at,
            parked=body.parked,
            heard_at=time.monotonic(),
        )
        log.info(
            "rank exited",
            job=job.name,
            generation=job.generation,
            node=session.node,
            rank=body.rank,
            exit_code=body.exit_code,
            signal=body.signal,
            stopped_by_agent=body.stopped_by_agent,
        )
        self.state.wake.set()

    def _on_checkpoint_saved(self, session: AgentSession, body) -> None:
        """A checkpoint every rank wrote: queued to be recorded in etcd."""
        job = self._job_for(body.job, body.generation)
        # A generation being stopped still commits what it saved before the stop.
        if (
            job is not None
            and job.state in (JobState.RUNNING, JobState.STOPPING)
            and not self._refused(
                session,
                "checkpoint_saved",
                checkpoint_refusal(
                    authority(job, session.node), commit_bounds(job), body.step, body.path
                ),
            )
            and _queue_commit(job, body)
        ):
            self.state.wake.set()

    def _on_memory_snapshot_saved(self, session: AgentSession, body) -> None:
        """A memory snapshot every node of the generation committed: queued to be
        recorded in etcd, with the generation's nodes (whose memory holds it); or, with
        ``replicated_to``, its copy now whole on that partner node, kept with the
        record."""
        job = self._job_for(body.job, body.generation)
        if (
            job is None
            or job.state not in (JobState.RUNNING, JobState.STOPPING)
            or self._refused(
                session,
                "memory_snapshot_saved",
                memory_snapshot_refusal(authority(job, session.node), body.step, job.spec.steps),
            )
        ):
            return
        held = job.unrecorded_memory_snapshot or job.last_memory_snapshot
        if body.replicated_to:
            record = memory_snapshots.with_replica(
                held, body.generation, body.step, body.replicated_to
            )
        elif memory_snapshots.supersedes(held, body.generation, body.step):
            record = memory_snapshots.carried(
                held,
                MemorySnapshotRecord(
                    step=body.step,
                    generation=body.generation,
                    samples=body.samples,
                    bytes=body.bytes,
                    nodes=tuple(sorted(job.nodes)),
                    recorded_at_unix=time.time(),
                ),
            )
        else:
            record = None
        if record is not None:
            job.unrecorded_memory_snapshot = record
            self.state.wake.set()

    def _on_checkpoint_problem(self, session: AgentSession, body) -> None:
        """A checkpoint ranks would not or could not use (a refused commit, a failed
        verification, one unreadable on the node, a fence lock held past its deadline),
        kept with the node that reported it."""
        # Any generation's: a refused commit comes from a superseded one.
        job = self.state.jobs.get(body.job)
        if job is None or body.generation > job.generation:
            return
        try:
            kind = WIRE_PROBLEM_KINDS.from_wire(body.kind)
        except ValueError as exc:
            self._refused(session, "checkpoint_problem", str(exc))
            return
        if self._refused(
            session,
            "checkpoint_problem",
            problem_refusal(authority(job, session.node), kind, body.generation, body.suspect_node),
        ):
            return
        job.checkpoint_problems.append((session.node, body))
        self.state.wake.set()

    def _on_generation_stopped(self, session: AgentSession, body) -> None:
        """The node's ranks of a generation are stopped."""
        job = self._job_for(body.job, body.generation)
        if job is not None:
            job.stopped_nodes.add(session.node)
            self.state.wake.set()

    def _on_hang_detected(self, session: AgentSession, body) -> None:
        """A hang the agent found, or the stacks it collected for another node's."""
        job = self._job_for(body.job, body.generation)
        if job is not None and job.state in (JobState.RUNNING, JobState.STOPPING):
            # A hang this agent found names its rank; the stacks it collected for
            # another node's hang (no phase) name none, only the ranks they are of.
            mine = authority(job, session.node)
            named = [body.rank] if body.phase else sorted(body.stacks)
            refusal = next(filter(None, (rank_refusal(mine, rank) for rank in named)), "")
            if not self._refused(session, "hang_detected", refusal):
                _hang(job, session.node, body)
                self.state.wake.set()

    def _on_preflight(self, session: AgentSession, body) -> None:
        """A rank's preflight figures."""
        job = self._job_for(body.job, body.generation)
        if job is not None and not self._refused(
            session, "preflight", rank_refusal(authority(job, session.node), body.rank)
        ):
            job.health.add_preflight(session.node, body, job.progress.step)
            job.goodput.preflight(body.generation, body.wall_s)
            self.state.wake.set()

    def _on_leaving(self, session: AgentSession, body) -> None:
        """The agent is shutting down (SIGTERM): an intent, like an operator's drain."""
        # An intent, like an operator's drain: the reconcile loop records it.
        session.leaving = body.reason or "its agent is shutting down"
        self.state.unsettled.add(session.node)
        self.state.wake.set()

    def _on_log_chunk(self, session: AgentSession, body) -> None:
        """A piece of a rank's output asked for by ``ReadLog``."""
        self.state.replies.deliver(body.request_id, (session.node, body))

    def _on_hello(self, session: AgentSession, body) -> None:
        """A second Hello on one stream is a mistake of the agent's: ignored."""
        log.warning("ignoring a second Hello on one stream", node=session.node)


def check_hello(hello: keel_pb2.Hello) -> str:
    """What is wrong with a Hello, or ""."""
    if not NODE_NAME.match(hello.node):
        return f"node name {hello.node!r}: {NODE_NAME_RULE}"
    if not 1 <= hello.slots <= MAX_SLOTS:
        return f"slots={hello.slots}: must be between 1 and {MAX_SLOTS}"
    if hello.lease_id <= 0:
        return "lease_id: grant an etcd lease and send its id"
    if not hello.host:
        return "host: give the address other nodes reach this node on"
    return ""


def agent_deadlines(hello: keel_pb2.Hello) -> dict[str, float]:
    """The deadlines an agent's Hello states (those it leaves 0 take the defaults)."""
    return {
        "heartbeat_s": hello.heartbeat_s,
        "reconnect_max_s": hello.reconnect_max_s,
        "lease_ttl_s": hello.lease_ttl_s,
    }


def deadline_misfit(hello: keel_pb2.Hello, config: ControllerConfig) -> str:
    """Why the agent's deadlines do not fit this controller's, or ""."""
    try:
        deadlines.resolve(
            **agent_deadlines(hello),
            node_lost_grace_s=config.node_lost_grace_s,
            leader_ttl_s=config.leader_ttl_s,
        )
    except deadlines.DeadlineError as exc:
        return f"the deadlines of agent {hello.node} do not fit this controller's: {exc}"
    return ""


def authority(job: JobRuntime, node: str) -> NodeAuthority:
    """What the plan of ``job``'s current generation lets ``node`` report."""
    ranks = job.ranks_on_node(node)
    return NodeAuthority(
        node=node,
        generation=job.generation,
        ranks=ranks,
        commits=0 in ranks,
        checkpoint_dir=job.spec.checkpoint_dir,
    )


class StepTally(
    collections.namedtuple(
        "StepTally", "step ranks step_times tokens at checkpoint_s restore_s loss"
    )
):
    """What the controller keeps of a ``NodeStep`` (one step of a node's ranks), read
    off the message once: a tuple, whose fields cost a fraction of a protobuf
    attribute's to read again (the job's progress, its health and its goodput each
    read them); ``ranks`` and ``step_times`` are tuples, in the same order."""

    __slots__ = ()


def _checked_steps(
    body: keel_pb2.StepReportBatch,
    mine: frozenset[int],
) -> tuple[list[StepTally], int, int | None]:
    """The batch's steps (its ``NodeStep``s) of ``mine`` (the ranks the node hosts),
    numbered from 1 with finite step times, as ``StepTally``; how many rank reports
    were not (the comparisons are false for NaN); and the first rank reported that is
    not the node's (None if none). Per entry, not per rank: a node's step costs about
    the same whatever its ranks."""
    checked, invalid, theirs = [], 0, None
    for entry in body.node_steps:
        ranks, times = tuple(entry.ranks), tuple(entry.step_time_s)
        count = len(ranks)
        if not (
            entry.step >= 1
            and count
            and len(times) == count
            and min(times) >= 0
            and max(times) < math.inf
            and not any(map(math.isnan, times))
        ):
            invalid += count or 1
            continue
        if not mine.issuperset(ranks) or len(set(ranks)) != count:
            ranks, times, other = _only_mine(ranks, times, mine)
            if theirs is None:
                theirs = other
            if not ranks:
                continue
        checked.append(
            StepTally(
                entry.step,
                ranks,
                times,
                entry.tokens,
                entry.at,
                entry.checkpoint_s,
                entry.restore_s,
                entry.loss,
            )
        )
    return checked, invalid, theirs


def _only_mine(ranks: tuple, times: tuple, mine: frozenset[int]) -> tuple[tuple, tuple, int | None]:
    """The ranks of ``mine``, each once (its first time), with their times; and the
    first rank that is not the node's (None if none)."""
    kept: dict[int, float] = {}
    other = None
    for rank, seconds in zip(ranks, times):
        if rank not in mine:
            other = rank if other is None else other
        elif rank not in kept:
            kept[rank] = seconds
    return tuple(kept), tuple(kept.values()), other


def _checked_replay(
    body: keel_pb2.StepReportBatch, mine: frozenset[int]
) -> tuple[list[keel_pb2.NodeStep], int, int | None]:
    """The replayed steps (each rank's latest, summed up per step) numbered from 1 whose
    first rank (the one whose loss they carry) is of ``mine``; how many rank reports
    were not numbered from 1; the first rank reported that is not the node's (None if
    none)."""
    checked, invalid, theirs = [], 0, None
    for entry in body.node_steps:
        if not entry.step >= 1:
            invalid += len(entry.ranks) or 1
            continue
        if theirs is None:
            theirs = next((rank for rank in entry.ranks if rank not in mine), None)
        if entry.ranks and entry.ranks[0] in mine:
            checked.append(entry)
    return checked, invalid, theirs


def _progress(job: JobRuntime, node_steps: list[keel_pb2.NodeStep]) -> None:
    """The job's step and loss are rank 0's latest."""
    for entry in node_steps:
        if entry.ranks[0] == 0 and entry.step >= job.progress.step:
            job.progress.step, job.progress.loss = entry.step, entry.loss


def _steps(job: JobRuntime, generation: int, node: str, tallies: list[StepTally]) -> None:
    """Steps of ``node``'s ranks first sent (``StepTally``s, checked): the job's tokens,
    step times, progress, health and goodput."""
    if not tallies:
        return
    tokens, latest, step_times = 0, 0.0, job.progress.step_times
    recent = job.progress.node_step_times.get(node)
    if recent is None:
        recent = job.progress.node_step_times[node] = collections.deque(maxlen=RECENT_STEPS)
    for tally in tallies:  # per node step: 4,000 a second at scale, 8 ranks each
        tokens += tally.tokens
        if tally.at > latest:
            latest = tally.at
        ranks, times = tally.ranks, tally.step_times
        step_times.extend(times if min(times) > 0 else [t for t in times if t > 0])
        recent.append((ranks, times))
        if ranks[0] == 0:
            if not job.progress.has_loss:
                job.progress.initial_loss, job.progress.has_loss = tally.loss, True
            if tally.step >= job.progress.step:
                job.progress.step, job.progress.loss = tally.step, tally.loss
    job.progress.tokens += tokens
    job.progress.token_window.add(latest, tokens)
    job.health.add_steps(node, tallies)
    job.goodput.steps(generation, tallies, time.time())
    if metrics.recovered(job.name, job.recovery, job.goodput.first_step):
        job.recovery = None


def commit_bounds(job: JobRuntime) -> CommitBounds:
    """How far a commit of ``job``'s current generation may go (``checkpoint_refusal``)."""
    return CommitBounds(
        recorded_step=max(
            [job.last_checkpoint.step if job.last_checkpoint else 0]
            + [r.step for r in job.unrecorded]
        ),
        reported_step=job.progress.step,
        target_steps=job.spec.steps,
    )


def _queue_commit(job: JobRuntime, saved: keel_pb2.CheckpointSaved) -> bool:
    """Queue a commit (checked) for the reconcile loop, which records it in etcd (an
    agent's message handler makes no etcd call); False if it is a replay: at or below
    a step recorded or queued (after a reconnect, the agent's replay of its newest
    commit comes before what its stream still had queued)."""
    if saved.step <= commit_bounds(job).recorded_step:
        return False
    job.unrecorded.append(
        CheckpointRecord(
            step=saved.step,
            path=saved.path,
            generation=saved.generation,
            samples=saved.samples,
            recorded_at_unix=time.time(),
        )
    )
    return True


def _hang(job: JobRuntime, node: str, report: keel_pb2.HangDetected) -> None:
    """Record a hang (or the stacks another agent collected for it) in one event."""
    health = job.health
    if health.hang_event is None:
        if not report.phase:
            return  # stacks for a stop that was not a hang
        health.hang_event = health.event(
            EventKind.HANG,
            "",
            node=node,
            rank=report.rank,
            step=report.last_step,
            detected_after_s=report.stalled_for_s,
        )
        health.hang_event.reason = (
            f"rank {report.rank} (pid {report.pid}) on {node} made no progress for "
            f"{report.stalled_for_s:.1f}s after step {report.last_step} "
            f"(timeout {report.timeout_s:.1f}s, {WIRE_HANG_PHASES.text(report.phase)})"
        )
    health.add_stacks(report.stacks)
