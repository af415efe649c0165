"""The controller daemon: agent streams, operator calls and the reconcile loop.

Each tick reads the whole observed state (etcd node records, agent sessions, what the
agents reported), asks ``policy.decide`` what to do with each job and applies the
answer. Handlers only record what they hear; they never decide.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf import json_format

from orchestrator.controller import metrics
from common.keys import NODE_NAME
from orchestrator.security.auth import TokenInterceptor, certificate_mismatch
from orchestrator.controller.config import ControllerConfig
from orchestrator.policy.guardrails import restart_backoff_s
from orchestrator.spec.health import resolve as resolve_health
from orchestrator.controller.job_health import REPLACE_CHECKPOINT_WAIT_S, JobHealth, Replacement
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.spec.jobspec import size_and_layout
from orchestrator.policy.lifecycle import JobState, check_transition
from orchestrator.controller.operator_service import OperatorService
from orchestrator.policy.placement import NodeRanks, place
from orchestrator.policy.job import Action, Decision, Observed, RankExit, Spec, decide
from common import env
from common.etcd import connect
from orchestrator.controller.store import Store, StaleRevision
from common.tls import add_port
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

MAX_SLOTS = 1024
# Each agent's Connect stream holds one server thread for as long as it lives; the
# pool (its threads are made as needed) has room for this many agents plus the
# operators' calls.
MAX_AGENTS = 4096
OPERATOR_THREADS = 64
TOKENS_WINDOW_S = 10.0


@dataclass(eq=False)
class AgentSession:
    node: str
    host: str
    slots: int
    lease_id: int
    pid: int
    outbox: queue.Queue = field(default_factory=queue.Queue)
    connected: bool = True
    disconnected_at: float = 0.0

    def send(self, message: keel_pb2.ControllerMessage) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.put(None)


class Controller(OperatorService, keel_pb2_grpc.ControllerServicer):
    def __init__(self, config: ControllerConfig):
        self.config = config
        self.id = uuid.uuid4().hex[:12]
        self.store = Store(connect(list(config.etcd_endpoints), config.etcd_timeout_s,
                                   config.etcd_credentials))
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.sessions: dict[str, AgentSession] = {}
        self.jobs: dict[str, JobRuntime] = {}
        self.registered: dict[str, dict] = {}   # node records last read from etcd
        self.cordons: dict[str, dict] = {}      # as in etcd; written only by the leader
        self.server: grpc.Server | None = None
        self.address = ""
        self._leader_lease = None
        self.is_leader = False
        self.leader_since = 0.0
        self.lease_refreshed_at = 0.0

    # ================================================================ lifecycle
    def serve(self) -> str:
        """Bind, start campaigning for leadership and, once leading, reconciling; return
        host:port. A standby answers every call with UNAVAILABLE and the leader's address."""
        self.server = grpc.server(futures.ThreadPoolExecutor(
                                      max_workers=MAX_AGENTS + OPERATOR_THREADS),
                                  interceptors=[TokenInterceptor(self.config.tokens
                                                                 or self.config.token)])
        keel_pb2_grpc.add_ControllerServicer_to_server(self, self.server)
        port = add_port(self.server, self.config.listen, self.config.tls)
        if port == 0:
            raise OSError(f"cannot listen on {self.config.listen}")
        self.server.start()
        self.address = f"{self.config.advertise_host}:{port}"
        if self.config.address_file:
            tmp = self.config.address_file.with_suffix(".tmp")
            tmp.write_text(self.address)
            tmp.replace(self.config.address_file)
        if self.config.metrics_port is not None:
            metrics.serve(self.config.metrics_port)
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()
        log.info("controller serving", address=self.address, controller_id=self.id,
                 mutual_tls=self.config.tls is not None,
                 role_tokens=self.config.tokens is not None)
        return self.address

    # =============================================================== leadership
    def _campaign(self, now: float) -> None:
        """One try at the leader key; on success rebuild everything from etcd."""
        # A standby keeps its lease alive between tries, and takes a new one if it lapsed.
        alive = False
        if self._leader_lease is not None:
            try:
                alive = self._leader_lease.refresh()[0].TTL > 0
            except Exception:
                alive = False
        if not alive:
            self._leader_lease = self.store.client.lease(int(self.config.leader_ttl_s))
        if not self.store.campaign(self.id, self.address, self._leader_lease.id):
            return
        with self.lock:
            self.jobs.clear()
            self._load_jobs()
            self.cordons = self.store.cordons()
            self.leader_since, self.lease_refreshed_at = now, now
            self.is_leader = True
        metrics.LEADER.set(1)
        log.info("leading", controller_id=self.id, address=self.address, jobs=len(self.jobs))

    def _keep_leading(self, now: float) -> bool:
        """Refresh the leader lease; step down if it lapsed. True while leading."""
        try:
            response = self._leader_lease.refresh()[0]
            if response.TTL > 0:
                self.lease_refreshed_at = now
                return True
            reason = "leader lease expired"
        except Exception as exc:
            if now - self.lease_refreshed_at < self.config.leader_ttl_s:
                return True  # etcd hiccup: the lease may still be alive
            reason = f"cannot refresh the leader lease: {exc}"
        self._step_down(reason)
        return False

    def _step_down(self, reason: str) -> None:
        with self.lock:
            self.is_leader = False
            for session in self.sessions.values():
                session.connected = False
                session.close()
            self.sessions.clear()
            self.jobs.clear()
        # The lease is kept: if etcd comes back with it alive and our key on it, nobody
        # led meanwhile and the next campaign takes the lead again at once, instead of
        # waiting a whole TTL for our own key to lapse.
        metrics.LEADER.set(0)
        log.warning("stepped down", controller_id=self.id, reason=reason)

    def _require_leader(self, context) -> None:
        if not self.is_leader:
            leader = None
            try:
                leader = self.store.controller_address()
            except Exception:
                pass
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"standby controller; the leader is at {leader or 'unknown'}")

    def shutdown(self, grace_s: float = 2.0) -> None:
        self.stopping.set()
        self.wake.set()
        with self.lock:
            for session in self.sessions.values():
                session.close()
        if self.server is not None:
            self.server.stop(grace_s).wait()
        if self._leader_lease is not None:
            try:
                self._leader_lease.revoke()
            except Exception as exc:  # etcd may already be gone at shutdown
                log.warning("could not revoke controller lease", error=str(exc))
        log.info("controller stopped")

    def _load_jobs(self) -> None:
        """Rebuild jobs from etcd, so a restarted controller knows what it runs. A job
        whose records this version cannot read is left out, loudly, rather than keep
        every controller from leading; etcd errors propagate (the campaign retries)."""
        for name in self.store.job_names():
            try:
                self._load_job(name)
            except (ValueError, KeyError, TypeError, json_format.ParseError) as exc:
                log.error("cannot read the job's records in etcd; not managing it",
                          job=name, error=f"{type(exc).__name__}: {exc}")

    def _load_job(self, name: str) -> None:
        spec_dict = self.store.job_spec(name)
        state = self.store.job_state(name)
        if spec_dict is None or state.value is None:
            return
        spec = json_format.ParseDict(spec_dict, keel_pb2.JobSpec())
        job = JobRuntime(spec=spec, state=JobState(state.value["state"]),
                         health=JobHealth(name, resolve_health(spec.health)),
                         state_rev=state.mod_revision, state_since=time.monotonic(),
                         generation=state.value["generation"],
                         restarts=state.value["restarts"],
                         reason=state.value.get("reason", ""),
                         failures=state.value.get("failures", []),
                         stop_requested=state.value.get("stop_requested", ""),
                         stop_now=state.value.get("stop_now", False),
                         planned_stop=state.value.get("planned_stop", False))
        plan = self.store.plan(name, job.generation) if job.generation else None
        if plan:
            job.world_size, job.mesh = plan["world_size"], plan["mesh"]
            if not job.state.terminal:
                job.placement = [NodeRanks(n, tuple(r)) for n, r in plan["nodes"].items()]
        checkpoints = self.store.checkpoints(name)
        job.last_checkpoint = checkpoints[-1] if checkpoints else None
        if state.value.get("initial_loss") is not None:
            job.initial_loss = job.loss = state.value["initial_loss"]
            job.has_loss = job.initial_loss_stored = True
        job.health.new_generation(job.generation, job.rank_nodes)
        job.health.restore([json_format.ParseDict(e, keel_pb2.Event(), ignore_unknown_fields=True)
                            for e in self.store.events(name)])
        self.jobs[name] = job

    # =================================================================== agents
    def Connect(self, request_iterator, context):
        self._require_leader(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the first message on an agent stream must be a Hello")
        hello = first.hello
        problem = self._check_hello(hello)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        problem = certificate_mismatch(context.auth_context(), hello.node)
        if problem:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        with self.lock:
            streams = sum(1 for s in self.sessions.values() if s.connected)
            full = streams >= MAX_AGENTS and not (hello.node in self.sessions
                                                  and self.sessions[hello.node].connected)
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this controller serves at most {MAX_AGENTS} agents")
        try:
            lease_alive = self.store.lease_alive(hello.lease_id)
            if lease_alive:
                self.store.put_node(hello.node, {"host": hello.host, "slots": hello.slots,
                                                 "pid": hello.pid, "lease_id": hello.lease_id},
                                    hello.lease_id)
        except Exception as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        if not lease_alive:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"etcd lease {hello.lease_id} of node {hello.node} is not alive; "
                          f"grant a new lease and reconnect")

        session = AgentSession(node=hello.node, host=hello.host, slots=hello.slots,
                               lease_id=hello.lease_id, pid=hello.pid)
        with self.lock:
            stepped_down = not self.is_leader  # since the check on entry
            if not stepped_down:
                previous = self.sessions.get(hello.node)
                if previous is not None:
                    previous.connected = False
                    previous.close()
                self.sessions[hello.node] = session
        if stepped_down:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "this controller stopped leading; find the leader in etcd")
        context.add_callback(session.close)
        session.send(keel_pb2.ControllerMessage(
            welcome=keel_pb2.Welcome(controller_id=self.id)))
        self._account_for_ranks(session, hello)
        log.info("agent connected", node=hello.node, slots=hello.slots, host=hello.host,
                 agents=self._connected_count())
        reader = threading.Thread(target=self._read_agent, args=(session, request_iterator),
                                  name=f"agent-{hello.node}", daemon=True)
        reader.start()
        self.wake.set()
        while True:
            message = session.outbox.get()
            if message is None:
                break
            yield message

    def _account_for_ranks(self, session: AgentSession, hello: keel_pb2.Hello) -> None:
        """Square what a (re)connecting agent runs with the plan. Ranks of the job's
        running generation are adopted; anything else it runs is stopped cleanly; and
        ranks planned on the node that the agent does not know of died with a previous
        agent (or never started), which ends their generation."""
        with self.lock:
            for job in self.jobs.values():
                if session.node not in job.nodes:
                    continue
                if (job.state is JobState.STARTING and job.rendezvous is None
                        and job.placement[0].node == session.node):
                    # The request may have been lost with the previous stream.
                    session.send(keel_pb2.ControllerMessage(
                        prepare_rendezvous=keel_pb2.PrepareRendezvous(
                            job=job.name, generation=job.generation)))
                if job.state not in (JobState.RUNNING, JobState.STOPPING) or (
                        hello.running_job == job.name
                        and hello.running_generation == job.generation):
                    continue
                if job.state is JobState.STOPPING:
                    job.stopped_nodes.add(session.node)  # nothing of it runs there
                    continue
                missing = [r for part in job.placement if part.node == session.node
                           for r in part.ranks if r not in job.exits]
                if missing and session.node not in job.vanished:
                    job.vanished[session.node] = missing
                    job.health.event(
                        "agent_restarted",
                        f"the agent of {session.node} (pid {hello.pid}) came back without "
                        f"rank(s) {', '.join(map(str, missing))} of generation "
                        f"{job.generation}: they died with its previous incarnation",
                        node=session.node, step=job.step)
            if not hello.running_job:
                return
            job = self.jobs.get(hello.running_job)
            current = (job is not None and job.state is JobState.RUNNING
                       and job.generation == hello.running_generation
                       and session.node in job.nodes)
        if current:
            log.info("adopted running ranks", job=hello.running_job, node=session.node,
                     generation=hello.running_generation,
                     ranks=[r.rank for r in hello.running])
            return
        log.info("stopping stale ranks", job=hello.running_job, node=session.node,
                 generation=hello.running_generation)
        session.send(keel_pb2.ControllerMessage(stop_generation=keel_pb2.StopGeneration(
            job=hello.running_job, generation=hello.running_generation,
            reason="not the job's running generation")))

    def _check_hello(self, hello: keel_pb2.Hello) -> str:
        if not NODE_NAME.match(hello.node):
            return (f"node name {hello.node!r}: use 1-63 letters, digits, '.', '_' or '-', "
                    f"starting with a letter or digit")
        if not 1 <= hello.slots <= MAX_SLOTS:
            return f"slots={hello.slots}: must be between 1 and {MAX_SLOTS}"
        if hello.lease_id <= 0:
            return "lease_id: grant an etcd lease and send its id"
        if not hello.host:
            return "host: give the address other nodes reach this node on"
        return ""

    def _read_agent(self, session: AgentSession, request_iterator) -> None:
        try:
            for message in request_iterator:
                with self.lock:
                    self._on_agent_message(session, message)
        except grpc.RpcError:
            pass  # the stream ended; the agent reconnects on its own
        except Exception:
            # A message we could not handle: end this stream (the agent reconnects and
            # replays), never the controller.
            log.exception("agent message failed; closing its stream", node=session.node)
        finally:
            with self.lock:
                session.connected = False
                session.disconnected_at = time.monotonic()
            session.close()
            log.info("agent disconnected", node=session.node, agents=self._connected_count())
            self.wake.set()

    def _connected_count(self) -> int:
        with self.lock:
            return sum(1 for s in self.sessions.values() if s.connected)

    def _job_for(self, job_name: str, generation: int) -> JobRuntime | None:
        """The job a report is about, if the report is for its current generation."""
        job = self.jobs.get(job_name)
        if job is None or generation != job.generation:
            return None
        return job

    def _on_agent_message(self, session: AgentSession, message) -> None:
        kind = message.WhichOneof("kind")
        body = getattr(message, kind) if kind else None
        if kind == "rendezvous_ready":
            job = self._job_for(body.job, body.generation)
            if (job and job.state is JobState.STARTING and job.placement
                    and job.placement[0].node == session.node and 0 < body.port < 65536):
                job.rendezvous = (body.host, body.port)
                self.wake.set()
        elif kind == "rank_exited":
            job = self._job_for(body.job, body.generation)
            if job is None:
                return
            exit_ = RankExit(node=session.node, rank=body.rank, pid=body.pid,
                             exit_code=body.exit_code, signal=body.signal,
                             exited_at=body.exited_at, stopped_by_agent=body.stopped_by_agent,
                             traceback=body.traceback, stderr_tail=body.stderr_tail,
                             last_step=body.last_step, reported_at=time.time(),
                             reaped_at=body.reaped_at)
            job.exits[body.rank] = exit_
            log.info("rank exited", job=job.name, generation=job.generation,
                     node=session.node, rank=body.rank, exit_code=body.exit_code,
                     signal=body.signal, stopped_by_agent=body.stopped_by_agent)
            self.wake.set()
        elif kind == "steps":
            job = self._job_for(body.job, body.generation)
            reports = [r for r in body.reports if _usable(r)]
            if len(reports) < len(body.reports):
                log.warning("ignoring step reports numbered below 1 or with a step time "
                            "that is not a finite number of seconds", node=session.node,
                            count=len(body.reports) - len(reports))
            if job is not None:
                if body.replayed:
                    self._on_progress(job, reports)
                else:
                    self._on_steps(job, reports)
        elif kind == "checkpoint_saved":
            job = self._job_for(body.job, body.generation)
            if job is not None and job.state is JobState.RUNNING:
                self._on_checkpoint(job, body)
        elif kind == "generation_stopped":
            job = self._job_for(body.job, body.generation)
            if job is not None:
                job.stopped_nodes.add(session.node)
                self.wake.set()
        elif kind == "hang_detected":
            job = self._job_for(body.job, body.generation)
            if job is not None and job.state in (JobState.RUNNING, JobState.STOPPING):
                self._on_hang(job, session.node, body)
        elif kind == "preflight":
            job = self._job_for(body.job, body.generation)
            if job is not None:
                for node in job.health.add_preflight(session.node, body):
                    self._on_slow_node(job, node, time.monotonic(), job.step, 0,
                                       "preflight: collective bus bandwidth below half of "
                                       "its peers'")
        elif kind == "hello":
            log.warning("ignoring a second Hello on one stream", node=session.node)

    def _on_progress(self, job: JobRuntime, reports) -> None:
        """The job's step and loss are rank 0's latest."""
        for report in reports:
            if report.rank == 0 and report.step >= job.step:
                job.step, job.loss = report.step, report.loss
        metrics.JOB_STEP.labels(job=job.name).set(job.step)

    def _on_steps(self, job: JobRuntime, reports) -> None:
        for report in reports:
            job.tokens += report.tokens
            if report.step_time_s > 0:
                job.step_times.append(report.step_time_s)
            job.token_window.append((report.at, report.tokens))
            if report.rank == 0 and not job.has_loss:
                job.initial_loss, job.has_loss = report.loss, True
        self._on_progress(job, reports)
        while job.token_window and job.token_window[-1][0] - job.token_window[0][0] > TOKENS_WINDOW_S:
            job.token_window.popleft()
        job.health.add_steps(reports)

    def _on_checkpoint(self, job: JobRuntime, saved: keel_pb2.CheckpointSaved) -> None:
        """Queue a commit for the reconcile loop, which records it in etcd: the agent's
        message handler makes no etcd call."""
        if job.last_checkpoint and job.last_checkpoint["step"] >= saved.step:
            return  # a replay after a reconnect
        if any(r["step"] == saved.step for r in job.unrecorded):
            return  # a replay of one already queued
        job.unrecorded.append({"step": saved.step, "path": saved.path,
                               "generation": saved.generation, "samples": saved.samples,
                               "recorded_at": time.time()})
        self.wake.set()

    def _record_checkpoint(self, job: JobRuntime, record: dict) -> None:
        """Commit a queued checkpoint in etcd; if etcd does not take it, it stays
        queued and the next tick tries again. Not recorded means not committed: until
        then the restore point stays the previous one."""
        try:
            self.store.record_checkpoint(job.name, record)
        except Exception as exc:
            log.warning("could not record checkpoint; will retry", job=job.name,
                        step=record["step"], error=str(exc))
            return
        job.unrecorded.remove(record)
        if job.last_checkpoint and job.last_checkpoint["step"] >= record["step"]:
            return  # a late retry of an older one
        job.last_checkpoint = record
        log.info("checkpoint committed", job=job.name, generation=record["generation"],
                 step=record["step"], path=record["path"])

    # ================================================================== health
    def _on_hang(self, job: JobRuntime, node: str, report: keel_pb2.HangDetected) -> None:
        """Record a hang (or the stacks another agent collected for it) in one event."""
        health = job.health
        if health.hang_event is None:
            if not report.phase:
                return  # stacks for a stop that was not a hang
            health.hang_event = health.event(
                "hang", "", node=node, rank=report.rank, step=report.last_step,
                detected_after_s=report.stalled_for_s)
            health.hang_event.reason = (
                f"rank {report.rank} (pid {report.pid}) on {node} made no progress for "
                f"{report.stalled_for_s:.1f}s after step {report.last_step} "
                f"(timeout {report.timeout_s:.1f}s, {report.phase})")
        health.add_stacks(report.stacks)
        health.avoid = {health.hang_event.node}
        self.wake.set()

    def _on_slow_node(self, job: JobRuntime, node: str, now: float, step: int,
                      after_steps: int, reason: str) -> None:
        """A straggler (or a node slow in preflight): event, guard rails, then the job's
        policy: alert only, or checkpoint now and replace/exclude it."""
        health = job.health
        health.event("straggler", reason, node=node, step=step,
                     detected_after_steps=after_steps)
        if health.note_flag(node, now) and node not in self.cordons:
            reason = f"flagged slow twice within an hour in job {job.name}"
            try:
                self._cordon(node, reason, by="straggler detector", drain=False)
                health.event("cordoned", f"{node} {reason}; no new generation will be "
                                         f"placed on it until `keel uncordon {node}`",
                             node=node, step=step)
            except Exception as exc:
                health.event("alert", f"could not cordon {node} ({reason}): {exc}", node=node)
        policy = health.spec.straggler_policy
        if policy == "alert" or health.replacing is not None or job.state is not JobState.RUNNING:
            return
        if not health.may_replace(now):
            health.event("alert", f"not replacing {node}: "
                                  f"{health.spec.max_replacements_per_hour} replacements "
                                  f"in the last hour already", node=node, step=step)
            return
        self._begin(job, Replacement(node=node, reason=f"{policy} straggler {node}",
                                     after_step=job.step, requested_at=now, policy=policy))

    def _begin(self, job: JobRuntime, operation: Replacement) -> None:
        """Start a checkpoint-then-stop: ask every rank for a checkpoint now (unless the
        operation skips it); the policy stops the generation once it is committed."""
        job.health.replacing = operation
        if operation.checkpoint:
            self._request_checkpoint(job, operation.reason)
        self.wake.set()

    def _request_checkpoint(self, job: JobRuntime, reason: str) -> None:
        for part in job.placement:
            session = self.sessions.get(part.node)
            if session is not None and session.connected:
                session.send(keel_pb2.ControllerMessage(checkpoint_now=keel_pb2.CheckpointNow(
                    job=job.name, generation=job.generation, reason=reason)))

    def _cordon(self, node: str, reason: str, by: str, drain: bool) -> dict:
        record = {"reason": reason, "by": by, "drain": drain, "at": time.time()}
        self.store.cordon(node, record)
        self.cordons[node] = record
        log.info("node cordoned", node=node, reason=reason, by=by, drain=drain)
        self.wake.set()
        return record

    def _ensure_operations(self, job: JobRuntime, now: float) -> None:
        """Level-based: a running job that the operator stopped, or that runs on a
        draining node, has its checkpoint-then-stop under way (again, after a failover)."""
        pending = job.health.replacing
        if job.stop_requested:
            if pending is None or pending.policy != "stop":
                self._begin(job, Replacement(node="", reason=job.stop_requested,
                                             after_step=job.step, requested_at=now,
                                             policy="stop", checkpoint=not job.stop_now))
            return
        draining = sorted(n for n in job.nodes if self.cordons.get(n, {}).get("drain"))
        if draining and pending is None:
            self._begin(job, Replacement(node=draining[0], reason=f"drain {', '.join(draining)}",
                                         after_step=job.step, requested_at=now,
                                         policy="drain"))

    def _replacement_ready(self, job: JobRuntime, now: float) -> str:
        """The reason to stop for a pending checkpoint-then-stop, once its checkpoint
        committed (or waiting for it took too long, or it asked for none)."""
        pending = job.health.replacing
        if pending is None:
            return ""
        if not pending.checkpoint:
            return f"{pending.reason}, without a final checkpoint"
        committed = job.last_checkpoint and job.last_checkpoint["step"] > pending.after_step \
            and job.last_checkpoint["generation"] == job.generation
        if committed:
            return f"{pending.reason} after checkpoint at step {job.last_checkpoint['step']}"
        if now - pending.requested_at > REPLACE_CHECKPOINT_WAIT_S:
            return (f"{pending.reason}; no checkpoint within "
                    f"{REPLACE_CHECKPOINT_WAIT_S:.0f}s, restoring the last committed one")
        return ""

    # ================================================================ reconcile
    def _loop(self) -> None:
        next_refresh, etcd_down_since = 0.0, 0.0
        while not self.stopping.is_set():
            self.wake.wait(self.config.tick_s)
            self.wake.clear()
            if self.stopping.is_set():
                break
            now = time.monotonic()
            try:
                if not self.is_leader:
                    if now >= next_refresh:
                        next_refresh = now + self.config.leader_ttl_s / 4
                        self._campaign(now)
                    if not self.is_leader:
                        continue
                elif now >= next_refresh:
                    next_refresh = now + self.config.leader_ttl_s / 3
                    if not self._keep_leading(now):
                        continue
                registered = self.store.nodes()
            except Exception as exc:
                if not etcd_down_since:
                    etcd_down_since = now
                    log.warning("etcd unreachable; retrying every tick", error=str(exc))
                continue
            if etcd_down_since:
                log.info("etcd reachable again", down_s=round(now - etcd_down_since, 2))
                etcd_down_since = 0.0
            with self.lock:
                self.registered = registered
                metrics.NODES.set(sum(1 for n in registered
                                      if n in self.sessions and self.sessions[n].connected))
                for job in list(self.jobs.values()):
                    if not job.state.terminal:
                        try:
                            self._reconcile(job, now)
                        except StaleRevision as exc:
                            log.error("job state changed under us; reloading", job=job.name,
                                      error=str(exc))
                            self._reload(job)
                        except Exception:
                            log.exception("reconcile failed; retrying next tick",
                                          job=job.name)
                    self._save_events(job)

    def _save_events(self, job: JobRuntime) -> None:
        """Write the job's new and changed events to etcd, so the next leader shows
        them too; what etcd does not take now is tried again next tick."""
        health = job.health
        try:
            for seq in list(health.dropped):
                self.store.delete_event(job.name, seq)
                health.dropped.remove(seq)
            for seq, event in list(health.unsaved.items()):
                # Hang stacks are bounded as they arrive (JobHealth.add_stacks).
                self.store.put_event(job.name, seq, json_format.MessageToDict(event))
                if health.unsaved.get(seq) is event:
                    del health.unsaved[seq]
        except Exception as exc:
            log.warning("could not save events; will retry", job=job.name, error=str(exc))

    def _reload(self, job: JobRuntime) -> None:
        """Take the job's state record as etcd has it. Runs in the reconcile thread,
        which must outlive etcd errors: if the read fails, the next tick's write fails
        on the stale revision again and lands here again."""
        try:
            state = self.store.job_state(job.name)
        except Exception as exc:
            log.warning("cannot reload the job's state; retrying next tick", job=job.name,
                        error=str(exc))
            return
        if state.value is not None:
            job.state = JobState(state.value["state"])
            job.state_rev = state.mod_revision
            job.generation = state.value["generation"]
            job.restarts = state.value["restarts"]

    def _node_usable(self, node: str, now: float) -> bool:
        session = self.sessions.get(node)
        if node not in self.registered:
            return False
        if session is None:
            # A controller that just took over gives agents time to reconnect.
            return now - self.leader_since < self.config.node_lost_grace_s
        return session.connected or now - session.disconnected_at < self.config.node_lost_grace_s

    def _free_slots(self, job: JobRuntime, avoid: bool = True) -> dict[str, int]:
        busy = set(self.cordons) | (job.health.avoid if avoid else set())
        for other in self.jobs.values():
            if other is not job and other.state.holds_nodes:
                busy |= other.nodes
        return {name: s.slots for name, s in self.sessions.items()
                if s.connected and name in self.registered and name not in busy}

    def _observe(self, job: JobRuntime, now: float, avoid: bool = True) -> Observed:
        for node in job.nodes - job.lost_nodes:
            if not self._node_usable(node, now):
                job.lost_nodes.add(node)
                session = self.sessions.get(node)
                gone_for = now - session.disconnected_at if session and not session.connected else 0.0
                job.health.event("node_lost", f"{node}: agent stream down {gone_for:.1f}s "
                                              f"or its etcd lease expired", node=node,
                                 step=job.step, detected_after_s=gone_for)
                job.health.avoid.add(node)
        hang = job.health.hang_event
        hang_reason = (hang.reason + (f"; {hang.root_cause}" if hang.root_cause else "")
                       if hang is not None and job.state is JobState.RUNNING else "")
        return Observed(state=job.state, state_since=job.state_since, restarts=job.restarts,
                        generation=job.generation, generation_world_size=job.world_size,
                        free_slots=self._free_slots(job, avoid), generation_nodes=job.nodes,
                        rendezvous_ready=job.rendezvous is not None,
                        exits=tuple(job.exits.values()),
                        lost_nodes=frozenset(job.lost_nodes),
                        vanished_nodes=frozenset(job.vanished),
                        unreachable_nodes=frozenset(
                            n for n in job.nodes - job.lost_nodes
                            if n in self.sessions and not self.sessions[n].connected),
                        stopped_nodes=frozenset(job.stopped_nodes),
                        hang=hang_reason,
                        replace=self._replacement_ready(job, now)
                        if job.state is JobState.RUNNING else "",
                        backoff_s=0.0 if job.planned_stop else restart_backoff_s(job.restarts),
                        stop_requested=job.stop_requested, planned_stop=job.planned_stop)

    def _reconcile(self, job: JobRuntime, now: float) -> None:
        spec = Spec(world_size=job.spec.world_size, max_restarts=job.spec.max_restarts,
                    rendezvous_timeout_s=self.config.rendezvous_timeout_s,
                    min_nodes=job.spec.min_nodes)
        for record in list(job.unrecorded):
            self._record_checkpoint(job, record)
        if job.has_loss and not job.initial_loss_stored:
            # Stored once, so a controller taking over reports the job's real start.
            job.state_rev = self.store.update_job_state(job.name, job.record(), job.state_rev)
            job.initial_loss_stored = True
        if job.state is JobState.RUNNING:
            for flag in job.health.evaluate_stragglers():
                self._on_slow_node(job, flag.node, now, flag.flagged_at_step,
                                   flag.flagged_at_step - flag.slow_since_step, flag.reason)
            self._ensure_operations(job, now)
        decision = decide(now, self._observe(job, now), spec)
        if (decision.action is Action.WAIT and job.state is JobState.PENDING
                and job.health.avoid - job.lost_nodes):
            # No spare to replace a suspect node: run on it rather than not at all.
            fallback = decide(now, self._observe(job, now, avoid=False), spec)
            if fallback.action is Action.PREPARE:
                suspects = sorted(job.health.avoid - job.lost_nodes)
                job.health.event("alert", f"no spare to replace {', '.join(suspects)}; "
                                          f"restarting on it", node=suspects[0])
                job.health.avoid &= job.lost_nodes
                decision = fallback
        if decision.action is Action.WAIT:
            if decision.reason != job.last_wait_reason:
                job.last_wait_reason = decision.reason
                log.info("waiting", job=job.name, generation=job.generation,
                         state=job.state.value, reason=decision.reason)
            return
        job.last_wait_reason = ""
        handler = {Action.PREPARE: self._prepare, Action.START: self._start,
                   Action.STOP: self._stop, Action.RESTART: self._restart,
                   Action.SUCCEED: self._finish, Action.FAIL: self._finish,
                   Action.CANCEL: self._finish}[decision.action]
        handler(job, decision, now)

    def _transition(self, job: JobRuntime, target: JobState, reason: str, now: float,
                    plan: dict | None = None, **changes: int | bool) -> None:
        """Persist the new state and ``changes`` (generation, restarts) in one
        revision-guarded write, and only then adopt them."""
        check_transition(job.state, target)
        previous = job.state
        record = job.record() | changes | {"state": target.value, "reason": reason}
        job.state_rev = self.store.update_job_state(job.name, record, job.state_rev, plan)
        for name, value in changes.items():
            setattr(job, name, value)
        job.state, job.reason, job.state_since = target, reason, now
        metrics.JOB_STATE.labels(job=job.name).set(list(JobState).index(target))
        metrics.JOB_GENERATION.labels(job=job.name).set(job.generation)
        log.info("job state", job=job.name, generation=job.generation,
                 **{"from": previous.value, "to": target.value}, reason=reason,
                 restarts=job.restarts)

    def _prepare(self, job: JobRuntime, decision: Decision, now: float) -> None:
        free = self._free_slots(job)
        # The checkpoint-then-stop that ended the last generation, if this is its sequel.
        pending = job.health.replacing if job.planned_stop else None
        if pending is not None and pending.node and pending.with_node:
            out, into = pending.node, pending.with_node
            wanted = (job.nodes - {out}) | {into}
            if wanted <= free.keys() and sum(free[n] for n in wanted) >= job.spec.world_size:
                free = {n: free[n] for n in wanted}
            else:
                job.health.event("alert", f"{into} can no longer take {out}'s place; "
                                          f"placing on any free node", node=out)
        shrink, ceiling = decision.shrink, 0
        if pending is not None and pending.node and pending.policy == "exclude":
            # The exclude policy drops the node even when a spare could take its place.
            shrink = True
            ceiling = job.world_size - job.ranks_on(pending.node)
        try:
            world_size, mesh = size_and_layout(job.spec, free, shrink, ceiling)
        except ValueError as exc:
            self._transition(job, JobState.FAILED, f"no layout can run: {exc}", now)
            return
        placement = place(world_size, free)
        reason = decision.reason
        if shrink:
            reason += f"; planner chose {mesh} at world size {world_size}"
        self._transition(job, JobState.STARTING, reason, now, generation=job.generation + 1,
                         planned_stop=False)
        previous = job.nodes
        job.placement, job.world_size, job.mesh = placement, world_size, mesh
        health = job.health
        out = sorted(health.avoid & previous)
        if out:
            newcomers = sorted(job.nodes - previous)
            health.replacement_times.append(now)
            if newcomers and not shrink:
                health.event("replaced", f"{', '.join(out)} replaced by "
                                         f"{', '.join(newcomers)}", node=out[0], step=job.step)
            else:
                health.event("excluded", f"{', '.join(out)} excluded; re-planned to "
                                         f"{mesh} at world size {world_size}", node=out[0],
                             step=job.step)
        health.avoid.clear()
        health.new_generation(job.generation, job.rank_nodes)
        job.rendezvous = None
        job.exits.clear()
        job.stopped_nodes.clear()
        job.lost_nodes.clear()
        job.vanished.clear()
        checkpoints = self.store.checkpoints(job.name)
        job.restore_from = checkpoints[-1] if checkpoints else None
        self.sessions[placement[0].node].send(keel_pb2.ControllerMessage(
            prepare_rendezvous=keel_pb2.PrepareRendezvous(job=job.name,
                                                          generation=job.generation)))

    def _start(self, job: JobRuntime, decision: Decision, now: float) -> None:
        host, port = job.rendezvous
        restore = job.restore_from["path"] if job.restore_from else ""
        plan = {"generation": job.generation, "world_size": job.world_size,
                "master_addr": host, "master_port": port,
                "nodes": {p.node: list(p.ranks) for p in job.placement},
                "restore_from": restore, "command": list(job.spec.command),
                "mesh": job.mesh,
                "created_at": time.time()}
        reason = (f"generation {job.generation}: {job.world_size} ranks on "
                  f"{len(job.placement)} nodes as {job.mesh}, "
                  + (f"restoring step {job.restore_from['step']}" if job.restore_from
                     else "fresh start"))
        self._transition(job, JobState.RUNNING, reason, now, plan)
        for part in job.placement:
            start = keel_pb2.StartGeneration(
                job=job.name, generation=job.generation, world_size=job.world_size,
                local_world_size=part.local_world_size, master_addr=host, master_port=port,
                command=list(job.spec.command), env=dict(job.spec.env),
                restart_count=job.restarts, checkpoint_dir=job.spec.checkpoint_dir,
                restore_from=restore, mesh=plan["mesh"], health=job.health.spec)
            if job.health.spec.preflight_off:
                start.env[env.PREFLIGHT] = "0"
            for local_rank, rank in enumerate(part.ranks):
                start.ranks.append(keel_pb2.RankAssignment(rank=rank, local_rank=local_rank))
            self.sessions[part.node].send(keel_pb2.ControllerMessage(start_generation=start))

    def _stop(self, job: JobRuntime, decision: Decision, now: float) -> None:
        pending = job.health.replacing
        if pending is not None and decision.replacement and pending.node:
            job.health.avoid.add(pending.node)
        cause = decision.root_cause
        if cause is not None:
            job.failures.append({
                "generation": job.generation, "node": cause.node, "rank": cause.rank,
                "pid": cause.pid, "exitCode": cause.exit_code, "signal": cause.signal,
                "traceback": cause.traceback[-8000:], "stderrTail": cause.stderr_tail[-4000:],
                "exitedAt": cause.exited_at, "lastStep": cause.last_step})
            job.health.event(
                "crash", decision.reason, node=cause.node, rank=cause.rank,
                step=cause.last_step,
                # From the process's exit (reaped within one agent tick of it) to the
                # controller knowing, traceback included.
                detected_after_s=max(0.0, cause.reported_at - (cause.reaped_at or cause.exited_at)),
                root_cause=cause.traceback[-8000:] or cause.stderr_tail[-2000:])
        self._transition(job, JobState.STOPPING, decision.reason, now,
                         planned_stop=decision.replacement)
        for node in job.nodes - job.lost_nodes:
            session = self.sessions.get(node)
            if session is not None and session.connected:
                session.send(keel_pb2.ControllerMessage(stop_generation=keel_pb2.StopGeneration(
                    job=job.name, generation=job.generation, reason=decision.reason,
                    collect_stacks=decision.collect_stacks)))

    def _restart(self, job: JobRuntime, decision: Decision, now: float) -> None:
        if decision.replacement:
            # Planned: spends no restart; planned_stop stays set through PENDING, so the
            # next generation starts without a failure's back-off.
            self._transition(job, JobState.PENDING, decision.reason, now)
            return
        self._transition(job, JobState.PENDING, decision.reason, now,
                         restarts=job.restarts + 1)
        metrics.JOB_RESTARTS.labels(job=job.name).inc()

    def _finish(self, job: JobRuntime, decision: Decision, now: float) -> None:
        target = {Action.SUCCEED: JobState.SUCCEEDED, Action.FAIL: JobState.FAILED,
                  Action.CANCEL: JobState.CANCELLED}[decision.action]
        self._transition(job, target, decision.reason, now)



def _usable(report: keel_pb2.StepReport) -> bool:
    """Steps are numbered from 1; a step time is finite seconds (0: not measured)."""
    return report.step >= 1 and math.isfinite(report.step_time_s) and \
        report.step_time_s >= 0

def run(config: ControllerConfig) -> None:
    """Serve until SIGTERM or SIGINT."""
    controller = Controller(config)
    controller.serve()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    controller.shutdown()

