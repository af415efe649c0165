"""The agent-local gRPC service that trainers reach over a Unix socket.

Every call names its caller: the rank token (``KEEL_RANK_TOKEN``, metadata
``x-keel-rank-token``) the agent gave the rank when it started it. A rank speaks only
for itself, in its own generation: its steps, its preflight, and, rank 0 alone,
commits inside the job's checkpoint directory and problems with checkpoints. A caller
without a live rank's token is refused (UNAUTHENTICATED, before its request is read:
``RankTokens``); a rank that reports for
another, or a path outside the directory, is refused (PERMISSION_DENIED) and nothing
is passed on. ``NextGeneration`` is for parked processes (``agent.parking``): the token
they parked with.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common import env, rpc
from common.call_bounds import KIB, MIB, RequestLimits, refusal
from common.paths import inside
from common.wire_kinds import WIRE_PROBLEM_KINDS, CheckpointProblemKind
from protos import keel_pb2, keel_pb2_grpc

MAX_REPORTS_PER_CALL = 4096


@dataclass(frozen=True)
class RankIdentity:
    """Who holds a rank token: ``ranks`` of ``generation`` of ``job`` (one rank, for the
    ranks an agent starts)."""

    job: str
    generation: int
    ranks: frozenset[int]
    checkpoint_dir: str


@dataclass(frozen=True)
class LocalCallbacks:
    """What the agent does with its ranks' calls. ``identify(token)``: the rank a
        token belongs to, None if none does; ``on_steps(generation, reports)`` returns the
        step after which the controller asked this generation for a checkpoint, None if it
        did not (answered to the trainer in the ack); ``recorded_step()``: the newest
        checkpoint the controller recorded, for the acks; ``on_attach(who, rank,
        restart_in_place)``; ``leaving(token)``: whether that rank is asked to leave its
        generation (in the acks); ``on_park(token, request)`` returns None if the rank is
        kept, else why not; ``next_generation(token)``: the answer for a parked process,
        None if no parked process holds the token; ``parked(token)``: whether one does (asked
    before the call's request is read, so it must not wait)."""

    identify: Callable[[str], RankIdentity | None]
    on_steps: Callable[[int, list], int | None]
    on_checkpoint: Callable[[keel_pb2.CheckpointSaved], None]
    on_memory_snapshot: Callable[[keel_pb2.MemorySnapshotSaved], None] = lambda _: None
    on_preflight: Callable[[keel_pb2.PreflightReport], None] = lambda _: None
    on_problem: Callable[[keel_pb2.CheckpointProblem], None] = lambda _: None
    recorded_step: Callable[[], int] = lambda: 0
    on_attach: Callable[[RankIdentity, int, bool], None] = lambda who, rank, keep: None
    leaving: Callable[[str], bool] = lambda token: False
    on_park: Callable[[str, keel_pb2.RankPark], str | None] = lambda token, park: "no"
    next_generation: Callable[[str], keel_pb2.NextGenerationAnswer | None] = lambda token: None
    parked: Callable[[str], bool] = lambda token: False


class AgentLocalService(keel_pb2_grpc.AgentLocalServicer):
    def __init__(self, callbacks: LocalCallbacks):
        self.callbacks = callbacks

    @staticmethod
    def _token(context) -> str:
        return dict(context.invocation_metadata()).get(env.RANK_TOKEN_METADATA, "")

    def _ack(self, context, **fields) -> keel_pb2.LocalAck:
        return keel_pb2.LocalAck(
            recorded_step=self.callbacks.recorded_step(),
            leave_generation=self.callbacks.leaving(self._token(context)),
            **fields,
        )

    def _caller(self, context, generation: int) -> RankIdentity:
        token = self._token(context)
        who = self.callbacks.identify(token) if token else None
        if who is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_RANK_TOKEN)
        if generation != who.generation:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"generation {generation}: this rank belongs to generation {who.generation}",
            )
        return who

    @staticmethod
    def _only(context, who: RankIdentity, rank: int, what: str) -> None:
        if rank not in who.ranks:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{what} of rank {rank}: this caller is rank(s) {sorted(who.ranks)}",
            )

    def Attach(self, request, context):
        who = self._caller(context, request.generation)
        self._only(context, who, request.rank, "an attach")
        self.callbacks.on_attach(who, request.rank, request.restart_in_place)
        return self._ack(context)

    def ReportSteps(self, request, context):
        who = self._caller(context, request.generation)
        if len(request.reports) > MAX_REPORTS_PER_CALL:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_REPORTS_PER_CALL} reports per call"
            )
        for report in request.reports:
            self._only(context, who, report.rank, "a step report")
        wanted = self.callbacks.on_steps(request.generation, list(request.reports))
        if wanted is None:
            return self._ack(context)
        return self._ack(context, checkpoint_now=True, checkpoint_after_step=wanted)

    def ReportPreflight(self, request, context):
        who = self._caller(context, request.generation)
        self._only(context, who, request.rank, "a preflight report")
        self.callbacks.on_preflight(request)
        return keel_pb2.LocalAck()

    def ReportCheckpoint(self, request, context):
        who = self._caller(context, request.generation)
        self._only(context, who, 0, "a checkpoint commit (rank 0's to report)")
        if not request.path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: the committed directory")
        # Absolute: the rank's working directory is not the agent's.
        if not os.path.isabs(request.path) or not inside(request.path, who.checkpoint_dir):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"path {request.path!r} is not inside the job's checkpoint directory "
                f"{who.checkpoint_dir or '(none: the job has no checkpoint_dir)'}",
            )
        self.callbacks.on_checkpoint(request)
        return self._ack(context)

    def ReportMemorySnapshot(self, request, context):
        who = self._caller(context, request.generation)
        self._only(context, who, 0, "a memory snapshot commit (rank 0's to report)")
        if request.job and request.job != who.job:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"job {request.job!r}: this rank belongs to job {who.job!r}",
            )
        if request.step == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "step: the snapshot's step, from 1")
        request.job = who.job
        self.callbacks.on_memory_snapshot(request)
        return self._ack(context)

    def ReportCheckpointProblem(self, request, context):
        who = self._caller(context, request.generation)
        self._only(context, who, 0, "a checkpoint problem (rank 0's to report)")
        try:
            WIRE_PROBLEM_KINDS.from_wire(request.kind)
        except ValueError:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"kind: one of {', '.join(k.value for k in CheckpointProblemKind)}",
            )
        self.callbacks.on_problem(request)
        return keel_pb2.LocalAck()

    def Park(self, request, context):
        who = self._caller(context, request.generation)
        self._only(context, who, request.rank, "a park")
        refused = self.callbacks.on_park(self._token(context), request)
        if refused:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"not kept for restart in place: {refused}"
            )
        return keel_pb2.LocalAck()

    def NextGeneration(self, request, context):
        answer = self.callbacks.next_generation(self._token(context))
        if answer is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_PARKED_TOKEN)
        return answer


SERVICE = "/keel.v1.AgentLocal/"
LOCAL_LIMITS = RequestLimits(
    per_method={
        # Up to MAX_REPORTS_PER_CALL step reports of about 100 bytes each.
        SERVICE + "ReportSteps": 1 * MIB,
        # Its reason is the error as the rank met it, not cut (a Park's is cut to
        # 8,000 characters by trainer.runtime).
        SERVICE + "ReportCheckpointProblem": 1 * MIB,
    },
    # The rest name a rank, a generation and a path, or carry a rank's few preflight
    # figures.
    default_bytes=64 * KIB,
)
# Calls served at once, per worker thread (gRPC refuses more, unread): a rank has
# at most a report and a parked poll in flight, and the workers are two per slot.
CALLS_PER_WORKER = 4

NO_RANK_TOKEN = "no live rank's token (KEEL_RANK_TOKEN): only ranks this agent started report here"
NO_PARKED_TOKEN = (
    "no parked rank's token (KEEL_RANK_TOKEN): only a rank that "
    "parked here asks for its next generation"
)


class RankTokens(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED), from its metadata alone and before its request is
    read, a call that carries no live rank's token: ``NextGeneration`` a parked
    process's, every other call a rank's (``common.call_bounds``). The handlers then
    check what the token allows."""

    def __init__(self, callbacks: LocalCallbacks):
        self.callbacks = callbacks

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        token = dict(handler_call_details.invocation_metadata).get(env.RANK_TOKEN_METADATA, "")
        if handler_call_details.method == SERVICE + "NextGeneration":
            known, why = bool(token) and self.callbacks.parked(token), NO_PARKED_TOKEN
        else:
            known, why = bool(token) and self.callbacks.identify(token) is not None, NO_RANK_TOKEN
        return handler if known else refusal(grpc.StatusCode.UNAUTHENTICATED, why)


def serve(socket_path: str, service: AgentLocalService, workers: int = 8) -> grpc.Server:
    """``workers``: calls served at once; a parked process holds one for up to a second
    at a time (``NextGeneration``), so give room for every slot's besides the reports.
    A call is judged by its rank token before its request is read (``RankTokens``), and
    held to its method's size in ``LOCAL_LIMITS``."""
    server = rpc.server(
        workers, LOCAL_LIMITS, CALLS_PER_WORKER * workers, [RankTokens(service.callbacks)]
    )
    keel_pb2_grpc.add_AgentLocalServicer_to_server(service, server)
    if server.add_insecure_port(f"unix:{socket_path}") == 0:
        raise OSError(f"cannot listen on unix socket {socket_path}")
    server.start()
    return server
