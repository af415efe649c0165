"""The operator's calls on the controller: submit, inspect and steer jobs and nodes.

A mixin of ``Controller``: every handler checks that this controller leads, validates
its request (a bad one is refused with the field and the fix, and changes nothing),
records the operator's intent in etcd and in memory, and leaves the doing to the
reconcile loop, which converges on it, after a failover too.
"""

from __future__ import annotations

import statistics
import time

import grpc
import structlog
from google.protobuf import json_format

from orchestrator.spec.health import resolve as resolve_health
from orchestrator.controller.job_health import JobHealth, Replacement
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.spec.jobspec import InvalidSpec, validate
from orchestrator.policy.lifecycle import JobState
from protos import keel_pb2

log = structlog.get_logger()

MAX_REASON_CHARS = 1024


class OperatorService:
    def SubmitJob(self, request, context):
        self._require_leader(context)
        spec = keel_pb2.JobSpec()
        spec.CopyFrom(request.spec)
        try:
            validate(spec)
        except InvalidSpec as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job spec: {exc}")
        with self.lock:
            if spec.name in self.jobs:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"job {spec.name!r} exists; choose another name")
            job = JobRuntime(spec=spec, state=JobState.PENDING, state_rev=0,
                             state_since=time.monotonic(), reason="submitted",
                             health=JobHealth(spec.name, resolve_health(spec.health)))
            try:
                revision = self.store.create_job(
                    spec.name, json_format.MessageToDict(spec), job.record())
            except Exception as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
            if not revision:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"job {spec.name!r} exists in etcd; choose another name")
            job.state_rev = revision
            self.jobs[spec.name] = job
        log.info("job submitted", job=spec.name, world_size=spec.world_size,
                 max_restarts=spec.max_restarts)
        self.wake.set()
        return keel_pb2.SubmitJobReply(job=spec.name)

    def GetJob(self, request, context):
        self._require_leader(context)
        with self.lock:
            job = self.jobs.get(request.job)
            if job is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {request.job!r}")
            return self._status(job)

    def ListJobs(self, request, context):
        self._require_leader(context)
        with self.lock:
            return keel_pb2.ListJobsReply(jobs=[self._status(job) for _, job in
                                                sorted(self.jobs.items())])

    def _status(self, job: JobRuntime) -> keel_pb2.JobStatus:
        window = job.token_window
        span = window[-1][0] - window[0][0] if len(window) > 1 else 0.0
        rate = sum(t for _, t in list(window)[1:]) / span if span > 0 else 0.0
        status = keel_pb2.JobStatus(
            job=job.name, state=job.state.value, reason=job.reason,
            generation=job.generation, world_size=job.world_size or job.spec.world_size,
            mesh=job.mesh, restarts=job.restarts, step=job.step, target_steps=job.spec.steps,
            loss=job.loss, initial_loss=job.initial_loss, has_loss=job.has_loss,
            tokens_per_s=rate, tokens=job.tokens,
            step_time_s=statistics.median(job.step_times) if job.step_times else 0.0)
        if job.last_checkpoint:
            ck = job.last_checkpoint
            status.last_checkpoint.CopyFrom(keel_pb2.CommittedCheckpoint(
                step=ck["step"], path=ck["path"], generation=ck["generation"],
                samples=ck["samples"]))
        for failure in job.failures:
            status.failures.append(json_format.ParseDict(failure, keel_pb2.Failure()))
        status.events.extend(job.health.events)
        status.preflight.extend(job.health.preflight_status())
        return status

    def ListNodes(self, request, context):
        self._require_leader(context)
        with self.lock:
            names = set(self.registered) | set(self.sessions) | set(self.cordons)
            return keel_pb2.ListNodesReply(nodes=[self._node_info(n) for n in sorted(names)])

    # ------------------------------------------------------------------ helpers
    def _node_info(self, name: str) -> keel_pb2.NodeInfo:
        session = self.sessions.get(name)
        record = self.registered.get(name, {})
        cordon = self.cordons.get(name)
        job = self._job_on(name)
        if cordon is None:
            state = "ready"
        elif cordon["drain"]:
            state = "draining" if job is not None else "drained"
        else:
            state = "cordoned"
        return keel_pb2.NodeInfo(
            node=name, host=record.get("host", session.host if session else ""),
            slots=record.get("slots", session.slots if session else 0),
            connected=bool(session and session.connected),
            lease_id=record.get("lease_id", 0), state=state,
            cordon_reason=("" if cordon is None else cordon["reason"] if cordon["by"] == "operator"
                           else f"{cordon['reason']} (by the {cordon['by']})"),
            job=job.name if job is not None else "")

    def _job_on(self, node: str) -> JobRuntime | None:
        """The job whose current generation runs (or is being started or stopped) on
        ``node``."""
        return next((j for j in self.jobs.values()
                     if j.state.holds_nodes and node in j.nodes), None)

    @staticmethod
    def _short_reason(reason: str, context) -> None:
        """An operator's reason is stored with the cordon or the job's state, and
        repeated in its events: keep it a sentence."""
        if len(reason) > MAX_REASON_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"reason: {len(reason)} characters; keep it under "
                          f"{MAX_REASON_CHARS}")

    def _known_node(self, name: str, context) -> None:
        if not name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node: give the node's name")
        if not (name in self.registered or name in self.sessions or name in self.cordons
                or self._job_on(name) is not None):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no node named {name!r}; `keel nodes` lists them")

    def _job_named(self, name: str, context) -> JobRuntime:
        job = self.jobs.get(name)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no job named {name!r}; `keel jobs` lists them")
        return job

    def _persist_cordon(self, node: str, reason: str, drain: bool, context) -> None:
        try:
            self._cordon(node, reason, by="operator", drain=drain)
        except Exception as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable, nothing changed: "
                                                       f"{exc}")

    def _spare_slots(self, job: JobRuntime) -> dict[str, int]:
        """Free slots on nodes the job does not run on now."""
        return {n: s for n, s in self._free_slots(job).items() if n not in job.nodes}

    def _where_it_goes(self, job: JobRuntime, node: str) -> str:
        """How the job will do without ``node``, judged from the free nodes now."""
        needed = job.ranks_on(node)
        free = sum(self._spare_slots(job).values())
        if free >= needed:
            return f"on free nodes ({free} slot(s) free, {needed} needed)"
        if job.spec.min_nodes:
            return (f"on a re-planned smaller layout (no free node for its {needed} "
                    f"rank(s); min_nodes {job.spec.min_nodes})")
        return (f"once {needed} slot(s) are free: the job may not shrink (min_nodes 0) and "
                f"no free node can take its {needed} rank(s)")

    # -------------------------------------------------------------------- nodes
    def CordonNode(self, request, context):
        self._require_leader(context)
        self._short_reason(request.reason, context)
        with self.lock:
            self._known_node(request.node, context)
            existing = self.cordons.get(request.node)
            if existing is None:
                self._persist_cordon(request.node, request.reason or "cordoned by the operator",
                                     False, context)
            job = self._job_on(request.node)
            message = (f"{request.node} was already {'draining' if existing['drain'] else 'cordoned'}"
                       if existing else f"{request.node} cordoned: no new generation goes there")
            if job is not None:
                message += f"; job {job.name} keeps running on it (`keel drain` moves it)"
            return keel_pb2.NodeReply(node=self._node_info(request.node), message=message)

    def UncordonNode(self, request, context):
        self._require_leader(context)
        with self.lock:
            self._known_node(request.node, context)
            if request.node not in self.cordons:
                return keel_pb2.NodeReply(node=self._node_info(request.node),
                                          message=f"{request.node} was not cordoned")
            try:
                self.store.uncordon(request.node)
            except Exception as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"etcd unavailable, nothing changed: {exc}")
            was = self.cordons.pop(request.node)
            message = f"{request.node} uncordoned: new generations may go there again"
            job = self._job_on(request.node)
            pending = job.health.replacing if job is not None else None
            if pending is not None and pending.policy == "drain":
                # The drain is called off; a checkpoint it asked for does no harm.
                job.health.replacing = None
                job.health.event("operator", f"drain of {request.node} called off",
                                 node=request.node, step=job.step)
                message += f"; the drain is called off and job {job.name} stays on it"
            log.info("node uncordoned", node=request.node, was=was["reason"])
            self.wake.set()
            return keel_pb2.NodeReply(node=self._node_info(request.node), message=message)

    def DrainNode(self, request, context):
        self._require_leader(context)
        self._short_reason(request.reason, context)
        with self.lock:
            self._known_node(request.node, context)
            self._persist_cordon(request.node, request.reason or "drained by the operator",
                                 True, context)
            job = self._job_on(request.node)
            if job is None:
                message = f"{request.node} drained: it runs nothing, and no new generation goes there"
            else:
                job.health.event("operator", f"drain of {request.node} requested",
                                 node=request.node, step=job.step)
                message = (f"draining {request.node}: job {job.name} checkpoints now, then "
                           f"its next generation runs without it "
                           f"{self._where_it_goes(job, request.node)}")
            return keel_pb2.NodeReply(node=self._node_info(request.node), message=message)

    def ReplaceNode(self, request, context):
        self._require_leader(context)
        with self.lock:
            self._known_node(request.node, context)
            job = self._job_on(request.node)
            if job is None or job.state is not JobState.RUNNING:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{request.node} runs no running job; nothing to replace")
            if job.health.replacing is not None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"job {job.name} is already under way to "
                              f"{job.health.replacing.reason}; wait for its next generation")
            needed = job.ranks_on(request.node)
            free = self._spare_slots(job)
            if request.with_node:
                self._known_node(request.with_node, context)
                problem = ""
                if request.with_node in job.nodes:
                    problem = f"it already runs job {job.name}"
                elif request.with_node in self.cordons:
                    problem = "it is cordoned (`keel uncordon` it first)"
                elif request.with_node not in free:
                    problem = "it is not free (disconnected or running another job)"
                elif free[request.with_node] < needed:
                    problem = (f"it has {free[request.with_node]} slot(s) and "
                               f"{request.node} runs {needed} rank(s)")
                if problem:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{request.with_node} cannot take {request.node}'s place: "
                                  f"{problem}")
            elif sum(free.values()) < needed:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no free node can take {request.node}'s {needed} rank(s); add "
                              f"a node, or `keel drain {request.node}` to re-plan smaller")
            into = request.with_node or "a free node"
            reason = f"operator: replace {request.node} with {into}"
            self._begin(job, Replacement(node=request.node, reason=reason,
                                         after_step=job.step, requested_at=time.monotonic(),
                                         policy="replace", with_node=request.with_node))
            job.health.event("operator", f"replacement of {request.node} with {into} requested",
                             node=request.node, step=job.step)
            return keel_pb2.NodeReply(
                node=self._node_info(request.node),
                message=f"job {job.name} checkpoints now, then its next generation runs with "
                        f"{request.node} replaced by {into}")

    # --------------------------------------------------------------------- jobs
    def CheckpointJob(self, request, context):
        self._require_leader(context)
        with self.lock:
            if request.job:
                job = self._job_named(request.job, context)
            else:
                running = [j for j in self.jobs.values() if j.state is JobState.RUNNING]
                if len(running) != 1:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  "job: name the job to checkpoint; running: "
                                  + (", ".join(sorted(j.name for j in running)) or "none"))
                job = running[0]
            if job.state is not JobState.RUNNING:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"job {job.name} is {job.state.value}; only a running job can "
                              f"checkpoint")
            self._request_checkpoint(job, "requested by the operator")
            job.health.event("operator", f"checkpoint requested after step {job.step}",
                             step=job.step)
            return keel_pb2.CheckpointJobReply(job=job.name, generation=job.generation,
                                               after_step=job.step)

    def StopJob(self, request, context):
        self._require_leader(context)
        self._short_reason(request.reason, context)
        with self.lock:
            job = self._job_named(request.job, context)
            if job.state.terminal:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"job {job.name} already ended {job.state.value}")
            if not job.stop_requested:
                reason = "stopped by the operator" + (f": {request.reason}" if request.reason
                                                      else "")
                before = job.stop_requested, job.stop_now
                job.stop_requested, job.stop_now = reason, request.now
                try:
                    job.state_rev = self.store.update_job_state(job.name, job.record(),
                                                                job.state_rev)
                except Exception as exc:
                    job.stop_requested, job.stop_now = before
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"could not record the stop, nothing changed: {exc}")
                job.health.event("operator", reason, step=job.step)
                log.info("job stop requested", job=job.name, reason=reason, now=request.now)
                self.wake.set()
            if job.state is JobState.RUNNING and not job.stop_now:
                message = f"job {job.name} checkpoints now, then stops"
            else:
                message = f"job {job.name} is stopping"
            return keel_pb2.StopJobReply(job=job.name, state=job.state.value, message=message)
