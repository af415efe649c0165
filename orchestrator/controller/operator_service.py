"""The operator's calls on the controller: submit, inspect and steer jobs and nodes.

Every handler checks that this controller leads, validates its request (a bad one is
refused with the field and the fix, and changes nothing), records the operator's
intent in etcd and in memory, and leaves the doing to the reconcile loop, which
converges on it, after a failover too.
"""

from __future__ import annotations

import statistics
import time
import uuid

import grpc
import structlog

from common import keys
from common.keys import NODE_NAME, NODE_NAME_RULE
from common.records import CertificateRecord, CheckpointRequestRecord, RecordError
from orchestrator.controller import observe
from orchestrator.controller.executor import Executor
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.leadership import Leadership
from orchestrator.controller.state import ControllerState
from orchestrator.controller.store import Deposed
from orchestrator.policy import certificates, operations
from orchestrator.policy.admission import directory_taken
from orchestrator.policy.event_kind import EventKind
from orchestrator.policy.lifecycle import WIRE_STATES, JobState
from orchestrator.policy.node_state import WIRE_NODE_STATES, NodeState
from orchestrator.policy.operations import Operation
from orchestrator.spec.jobspec import InvalidSpec, validate
from protos import keel_pb2

log = structlog.get_logger()

MAX_REASON_CHARS = 1024
# How long a ReadLog waits for the node's agent to answer.
LOG_READ_TIMEOUT_S = 5.0


class OperatorService:
    def __init__(self, state: ControllerState, leadership: Leadership, executor: Executor):
        self.state = state
        self.store = state.store
        self.leadership = leadership
        self.executor = executor
        self.lock = state.lock
        # (what it was built from, the reply): ListNodes
        self._nodes_reply: tuple[tuple, keel_pb2.ListNodesReply] | None = None

    def _require_leader(self, context) -> None:
        self.leadership.require(context)

    def _unrecorded(self, exc: Exception, context) -> None:
        """An intent etcd did not take: the call fails and nothing changed. A write
        refused because another controller leads ends this leadership too."""
        if isinstance(exc, Deposed):
            self.leadership.step_down(f"deposed: {exc}")
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "this controller no longer leads; nothing changed: ask the leader",
            )
        context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable, nothing changed: {exc}")

    def SubmitJob(self, request, context):
        self._require_leader(context)
        spec = keel_pb2.JobSpec()
        spec.CopyFrom(request.spec)
        try:
            validate(spec)
        except InvalidSpec as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job spec: {exc}")
        with self.lock:
            if spec.name in self.state.jobs:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"job {spec.name!r} exists; choose another name"
                )
            taken = directory_taken(
                spec,
                [
                    (j.name, j.job_id, j.state.value, j.spec.checkpoint_dir)
                    for j in self.state.jobs.values()
                ],
            )
            if taken:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, taken)
            job = JobRuntime.new(
                spec,
                JobState.PENDING,
                0,
                time.monotonic(),
                reason="submitted",
                job_id=uuid.uuid4().hex,
            )
            try:
                created = self.executor.create(job)
            except Exception as exc:
                self._unrecorded(exc, context)
            if not created:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"job {spec.name!r} exists in etcd; choose another name",
                )
        log.info(
            "job submitted",
            job=spec.name,
            world_size=spec.world_size,
            max_restarts=spec.max_restarts,
        )
        self.state.wake.set()
        return keel_pb2.SubmitJobReply(job=spec.name)

    def GetJob(self, request, context):
        self._require_leader(context)
        with self.lock:
            job = self.state.jobs.get(request.job)
            if job is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {request.job!r}")
            return self._status(job)

    def ListJobs(self, request, context):
        self._require_leader(context)
        with self.lock:
            return keel_pb2.ListJobsReply(
                jobs=[self._status(job) for _, job in sorted(self.state.jobs.items())]
            )

    def _status(self, job: JobRuntime) -> keel_pb2.JobStatus:
        status = keel_pb2.JobStatus(
            job=job.name,
            job_id=job.job_id,
            state=WIRE_STATES.to_wire(job.state),
            reason=job.reason,
            generation=job.generation,
            world_size=job.world_size or job.spec.world_size,
            mesh=job.mesh,
            restarts=job.restarts,
            step=job.progress.step,
            target_steps=job.spec.steps,
            loss=job.progress.loss,
            initial_loss=job.progress.initial_loss,
            has_loss=job.progress.has_loss,
            tokens_per_s=job.progress.tokens_per_s(),
            tokens=job.progress.tokens,
            step_time_s=statistics.median(job.progress.step_times)
            if job.progress.step_times
            else 0.0,
        )
        if job.last_checkpoint:
            ck = job.last_checkpoint
            status.last_checkpoint.CopyFrom(
                keel_pb2.CommittedCheckpoint(
                    step=ck.step, path=ck.path, generation=ck.generation, samples=ck.samples
                )
            )
        if job.last_memory_snapshot:
            snapshot = job.last_memory_snapshot
            status.last_memory_snapshot.CopyFrom(
                keel_pb2.MemorySnapshot(
                    step=snapshot.step,
                    generation=snapshot.generation,
                    samples=snapshot.samples,
                    bytes=snapshot.bytes,
                    nodes=list(snapshot.nodes),
                    recorded_at=snapshot.recorded_at_unix,
                    replica_step=snapshot.replica_step,
                    replica_node=snapshot.replica_node,
                )
            )
        status.failures.extend(job.failures)
        status.events.extend(job.health.events)
        status.preflight.extend(job.health.preflight_status())
        goodput = job.goodput
        status.goodput.CopyFrom(
            keel_pb2.Goodput(
                ratio=goodput.ratio() or 0.0,
                accounted_s=goodput.accounted_s,
                seconds=goodput.seconds,
                at_risk_s=goodput.at_risk_s,
            )
        )
        status.submitted_at, status.ended_at = goodput.start, job.ended_at_unix or 0.0
        return status

    def ListNodes(self, request, context):
        self._require_leader(context)
        state = self.state
        with self.lock:
            # Built again only when what it shows changed: the node tables, or which
            # job holds which nodes (a build holds the lock for a time that grows with
            # the nodes: docs/BENCHMARKS.md, control_plane).
            key = (
                state.nodes_version(),
                tuple((job.name, job.state, job.nodes) for job in state.jobs.values()),
            )
            if self._nodes_reply is None or self._nodes_reply[0] != key:
                names = set(state.registered) | set(state.sessions) | set(state.cordons)
                self._nodes_reply = (
                    key,
                    keel_pb2.ListNodesReply(nodes=[self._node_info(n) for n in sorted(names)]),
                )
            return self._nodes_reply[1]

    # ------------------------------------------------------------------ helpers
    def _node_info(self, name: str) -> keel_pb2.NodeInfo:
        session = self.state.sessions.get(name)
        record = self.state.registered.get(name)
        cordon = self.state.cordons.get(name)
        job = self.state.job_on(name)
        return keel_pb2.NodeInfo(
            node=name,
            host=record.host if record else session.host if session else "",
            slots=record.slots if record else session.slots if session else 0,
            connected=bool(session and session.connected),
            lease_id=record.lease_id if record else 0,
            state=WIRE_NODE_STATES.to_wire(NodeState(self.state.node_state(name))),
            cordon_reason=(
                ""
                if cordon is None
                else cordon.reason
                if cordon.by == "operator"
                else f"{cordon.reason} (by the {cordon.by})"
            ),
            job=job.name if job is not None else "",
        )

    @staticmethod
    def _short_reason(reason: str, context) -> None:
        """An operator's reason is stored with the cordon or the job's state, and
        repeated in its events: keep it a sentence."""
        if len(reason) > MAX_REASON_CHARS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reason: {len(reason)} characters; keep it under {MAX_REASON_CHARS}",
            )

    def _known_node(self, name: str, context) -> None:
        if not name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node: give the node's name")
        state = self.state
        if not (
            name in state.registered
            or name in state.sessions
            or name in state.cordons
            or state.job_on(name) is not None
        ):
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"no node named {name!r}; `keel nodes` lists them"
            )

    def _job_named(self, name: str, context) -> JobRuntime:
        job = self.state.jobs.get(name)
        if job is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"no job named {name!r}; `keel jobs` lists them"
            )
        return job

    def _persist_cordon(self, node: str, reason: str, drain: bool, context) -> None:
        try:
            self.executor.cordon(node, reason, by="operator", drain=drain)
        except Exception as exc:
            self._unrecorded(exc, context)

    def _where_it_goes(self, job: JobRuntime, node: str) -> str:
        """How the job will do without ``node``, judged from the free nodes now."""
        return operations.without_node(
            job.ranks_on(node), observe.spare_slots(self.state, job), job.spec.min_nodes
        )

    # -------------------------------------------------------------------- nodes
    def CordonNode(self, request, context):
        self._require_leader(context)
        self._short_reason(request.reason, context)
        with self.lock:
            self._known_node(request.node, context)
            existing = self.state.cordons.get(request.node)
            if existing is None:
                self._persist_cordon(
                    request.node, request.reason or "cordoned by the operator", False, context
                )
            job = self.state.job_on(request.node)
            message = (
                f"{request.node} was already {'draining' if existing.drain else 'cordoned'}"
                if existing
                else f"{request.node} cordoned: no new generation goes there"
            )
            if job is not None:
                message += f"; job {job.name} keeps running on it (`keel drain` moves it)"
            return keel_pb2.NodeReply(node=self._node_info(request.node), message=message)

    def UncordonNode(self, request, context):
        self._require_leader(context)
        with self.lock:
            self._known_node(request.node, context)
            if request.node not in self.state.cordons:
                return keel_pb2.NodeReply(
                    node=self._node_info(request.node), message=f"{request.node} was not cordoned"
                )
            try:
                self.executor.uncordon(request.node, "the operator uncordoned it")
            except Exception as exc:
                self._unrecorded(exc, context)
            message = f"{request.node} uncordoned: new generations may go there again"
            job = self.state.job_on(request.node)
            pending = job.intents.operation if job is not None else None
            if pending is not None and pending.policy == "drain" and pending.node == request.node:
                # The reconcile loop calls it off: the node is no longer draining.
                message += f"; the drain is called off and job {job.name} stays on it"
            return keel_pb2.NodeReply(node=self._node_info(request.node), message=message)

    def DrainNode(self, request, context):
        self._require_leader(context)
        self._short_reason(request.reason, context)
        with self.lock:
            self._known_node(request.node, context)
            self._persist_cordon(
                request.node, request.reason or "drained by the operator", True, context
            )
            job = self.state.job_on(request.node)
            if job is None:
                message = (
                    f"{request.node} drained: it runs nothing, and no new generation goes there"
                )
            else:
                job.health.event(
                    EventKind.OPERATOR,
                    f"drain of {request.node} requested",
                    node=request.node,
                    step=job.progress.step,
                )
                message = (
                    f"draining {request.node}: job {job.name} checkpoints now, then "
                    f"its next generation runs without it "
                    f"{self._where_it_goes(job, request.node)}"
                )
            return keel_pb2.NodeReply(node=self._node_info(request.node), message=message)

    def ReplaceNode(self, request, context):
        self._require_leader(context)
        with self.lock:
            self._known_node(request.node, context)
            job = self.state.job_on(request.node)
            if job is None or job.state is not JobState.RUNNING:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{request.node} runs no running job; nothing to replace",
                )
            if job.intents.operation is not None:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job.name} is already under way to "
                    f"{job.intents.operation.reason}; wait for its next generation",
                )
            if request.with_node:
                self._known_node(request.with_node, context)
            problem = operations.replace_problem(
                request.node,
                request.with_node,
                job.name,
                job.nodes,
                job.ranks_on(request.node),
                observe.spare_slots(self.state, job),
                frozenset(self.state.cordons),
            )
            if problem:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            into = request.with_node or "a free node"
            operation = Operation(
                node=request.node,
                policy="replace",
                generation=job.generation,
                reason=f"operator: replace {request.node} with {into}",
                with_node=request.with_node,
            )
            try:
                self.store.put_operation(job.name, operation.record())
            except Exception as exc:
                self._unrecorded(exc, context)
            job.intents.operation = operation  # the reconcile loop begins it
            self.state.wake.set()
            job.health.event(
                EventKind.OPERATOR,
                f"replacement of {request.node} with {into} requested",
                node=request.node,
                step=job.progress.step,
            )
            return keel_pb2.NodeReply(
                node=self._node_info(request.node),
                message=f"job {job.name} checkpoints now, then its next generation runs with "
                f"{request.node} replaced by {into}",
            )

    # --------------------------------------------------------------------- jobs
    def CheckpointJob(self, request, context):
        self._require_leader(context)
        with self.lock:
            if request.job:
                job = self._job_named(request.job, context)
            else:
                running = [j for j in self.state.jobs.values() if j.state is JobState.RUNNING]
                if len(running) != 1:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "job: name the job to checkpoint; running: "
                        + (", ".join(sorted(j.name for j in running)) or "none"),
                    )
                job = running[0]
            if job.state is not JobState.RUNNING:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job.name} is {job.state.value}; only a running job can checkpoint",
                )
            request_ = CheckpointRequestRecord(
                generation=job.generation,
                after_step=job.progress.step,
                reason="requested by the operator",
            )
            try:
                self.store.put_checkpoint_request(job.name, request_)
            except Exception as exc:
                self._unrecorded(exc, context)
            # The reconcile loop passes it on to the agents.
            job.intents.checkpoint_request, job.intents.checkpoint_request_sent = request_, False
            self.state.wake.set()
            job.health.event(
                EventKind.OPERATOR,
                f"checkpoint requested after step {job.progress.step}",
                step=job.progress.step,
            )
            return keel_pb2.CheckpointJobReply(
                job=job.name, generation=job.generation, after_step=job.progress.step
            )

    def DeleteJob(self, request, context):
        """Forget a job that has ended: its spec, state, plans, events and checkpoint
        records go from etcd (its checkpoint directory stays: it is the user's data)."""
        self._require_leader(context)
        with self.lock:
            job = self._job_named(request.job, context)
            if not job.state.terminal:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job.name} is {job.state.value}; stop it first "
                    f"(`keel stop {job.name}`), then delete it",
                )
            try:
                self.executor.forget(job, "deleted by the operator")
            except Exception as exc:
                self._unrecorded(exc, context)
        where = (
            f"; its checkpoints stay in {job.spec.checkpoint_dir}"
            if job.spec.checkpoint_dir
            else ""
        )
        return keel_pb2.DeleteJobReply(job=job.name, message=f"job {job.name} deleted{where}")

    def StopJob(self, request, context):
        self._require_leader(context)
        self._short_reason(request.reason, context)
        with self.lock:
            job = self._job_named(request.job, context)
            if job.state.terminal:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job.name} already ended {job.state.value}",
                )
            if not job.intents.stop_requested:
                reason = "stopped by the operator" + (
                    f": {request.reason}" if request.reason else ""
                )
                try:
                    self.executor.request_stop(job, reason, request.now)
                except Exception as exc:
                    self._unrecorded(exc, context)
                job.health.event(EventKind.OPERATOR, reason, step=job.progress.step)
                log.info("job stop requested", job=job.name, reason=reason, now=request.now)
                self.state.wake.set()
            if job.state is JobState.RUNNING and not job.intents.stop_now:
                message = f"job {job.name} checkpoints now, then stops"
            else:
                message = f"job {job.name} is stopping"
            return keel_pb2.StopJobReply(
                job=job.name, state=WIRE_STATES.to_wire(job.state), message=message
            )

    # ------------------------------------------------------ nodes' certificates
    def ApproveCertificate(self, request, context):
        """Let ``request.node`` be signed its certificate (its waiting request, or,
        with none, or after a revocation, the next that asks)."""
        return self._certificate_call(request, context, certificates.on_approve)

    def RevokeCertificate(self, request, context):
        """Revoke ``request.node``'s certificate: nothing is signed or accepted for it
        until an approval, and its agent's session is closed now."""
        status = self._certificate_call(request, context, certificates.on_revoke)
        with self.lock:
            session = self.state.sessions.get(request.node)
            if session is not None and session.connected:
                self.state.detach(session, time.monotonic())
                session.close()
                log.warning("agent session closed: certificate revoked", node=request.node)
        return status

    def ListCertificates(self, request, context):
        try:
            found = self.store.certificates()
        except Exception as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        return keel_pb2.ListCertificatesReply(
            certificates=[_certificate_status(n, r) for n, r in sorted(found.items())]
        )

    def _certificate_call(self, request, context, decide) -> keel_pb2.CertificateStatus:
        self._require_leader(context)
        node = request.node
        if not NODE_NAME.match(node):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node {node!r}: {NODE_NAME_RULE}")
        try:
            stored = self.store.certificate(node)
            current = stored.value
        except RecordError:
            stored, current = None, None  # written anew: what the operator decides now
        except Exception as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        record, message = decide(node, current, f"an operator ({context.peer()})", time.time())
        if record is not None:
            seen = stored.mod_revision if stored is not None else self._revision_of(node)
            try:
                written = self.store.put_certificate(node, record, seen)
            except Exception as exc:
                self._unrecorded(exc, context)
            if not written:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"node {node}'s certificate record changed meanwhile; nothing "
                    f"changed: run it again",
                )
            log.info("certificate record", node=node, state=record.state.value, by=record.by)
        status = _certificate_status(node, record or current)
        status.message = message
        return status

    def _revision_of(self, node: str) -> int:
        """The revision of a certificate record that does not parse (to replace it)."""
        _, meta = self.store.client.get(keys.certificate(node))
        return meta.mod_revision if meta is not None else 0

    def ReadLog(self, request, context):
        """A rank's output from the node that ran it, relayed through that node's agent
        stream (no port of the agent's is reached from outside)."""
        self._require_leader(context)
        with self.lock:
            job = self._job_named(request.job, context)
            generation = request.generation or job.generation
            if generation == 0:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job.name} has not started a generation yet "
                    f"({job.state.value}: {job.reason}); no rank has output",
                )
            node = job.node_of(generation, request.rank)
            if node is None:
                where = f"under {job.name}/gen{generation}/ in the run directory of its agent"
                if generation > job.generation:
                    problem = (
                        f"generation {generation} of job {job.name} has not started "
                        f"(it is at generation {job.generation})"
                    )
                elif generation == job.generation or generation in job.placements:
                    ranks = (
                        job.world_size
                        if generation == job.generation
                        else len(job.placements[generation])
                    )
                    problem = (
                        f"generation {generation} of job {job.name} has no rank "
                        f"{request.rank} (ranks 0-{ranks - 1})"
                    )
                else:
                    problem = (
                        f"generation {generation} of job {job.name} was placed before "
                        f"this controller led, so which node ran rank "
                        f"{request.rank} is not known here; its output is {where}"
                    )
                context.abort(grpc.StatusCode.NOT_FOUND, problem)
            request_id, answer = self.state.replies.expect()
            sent = self.state.send(
                node,
                keel_pb2.ControllerMessage(
                    read_log=keel_pb2.ReadLog(
                        request_id=request_id,
                        job=job.name,
                        generation=generation,
                        rank=request.rank,
                        out_offset=request.out_offset,
                        err_offset=request.err_offset,
                        max_bytes=request.max_bytes,
                    )
                ),
            )
        if not sent:
            self.state.replies.forget(request_id)
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node}, which ran rank {request.rank} of generation "
                f"{generation}, is not connected; its output stays on that node "
                f"under {job.name}/gen{generation}/ in its agent's run directory",
            )
        try:
            _, chunk = answer.result(timeout=LOG_READ_TIMEOUT_S)
        except TimeoutError:
            self.state.replies.forget(request_id)
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"node {node} did not send rank {request.rank}'s output within "
                f"{LOG_READ_TIMEOUT_S:.0f} s; try again",
            )
        if chunk.error:
            context.abort(grpc.StatusCode.NOT_FOUND, chunk.error)
        return keel_pb2.ReadLogReply(
            job=job.name,
            generation=generation,
            rank=request.rank,
            node=node,
            out=chunk.out,
            err=chunk.err,
            out_offset=chunk.out_offset,
            err_offset=chunk.err_offset,
            running=chunk.running,
            path=chunk.path,
        )


def _certificate_status(node: str, record: CertificateRecord | None) -> keel_pb2.CertificateStatus:
    if record is None:
        return keel_pb2.CertificateStatus(node=node, state="none")
    return keel_pb2.CertificateStatus(
        node=node,
        state=record.state.value,
        key_sha256=record.key_sha256,
        serial=record.serial,
        not_after_unix=record.not_after_unix,
        changed_at_unix=record.changed_at_unix,
        by=record.by,
        issued=record.issued,
    )
