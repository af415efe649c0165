"""The agent-local gRPC service that trainers reach over a Unix socket."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures

import grpc

from protos import keel_pb2, keel_pb2_grpc

MAX_REPORTS_PER_CALL = 4096


class AgentLocalService(keel_pb2_grpc.AgentLocalServicer):
    def __init__(self, on_steps: Callable[[int, list], bool],
                 on_checkpoint: Callable[[keel_pb2.CheckpointSaved], None],
                 on_preflight: Callable[[keel_pb2.PreflightReport], None] = lambda _: None,
                 on_problem: Callable[[keel_pb2.CheckpointProblem], None] = lambda _: None,
                 recorded_step: Callable[[], int] = lambda: 0):
        """``on_steps(generation, reports)`` returns whether the controller has asked
        this generation for a checkpoint (answered to the trainer in the ack);
        ``recorded_step()``: the newest checkpoint the controller recorded, for the acks."""
        self._on_steps = on_steps
        self._on_checkpoint = on_checkpoint
        self._on_preflight = on_preflight
        self._on_problem = on_problem
        self._recorded_step = recorded_step

    def ReportSteps(self, request, context):
        if len(request.reports) > MAX_REPORTS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"at most {MAX_REPORTS_PER_CALL} reports per call")
        wanted = self._on_steps(request.generation, list(request.reports))
        return keel_pb2.LocalAck(checkpoint_now=bool(wanted), recorded_step=self._recorded_step())

    def ReportPreflight(self, request, context):
        self._on_preflight(request)
        return keel_pb2.LocalAck()

    def ReportCheckpoint(self, request, context):
        if not request.path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: the committed directory")
        self._on_checkpoint(request)
        return keel_pb2.LocalAck(recorded_step=self._recorded_step())

    def ReportCheckpointProblem(self, request, context):
        if request.kind not in ("stale_commit", "quarantined"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "kind: stale_commit or quarantined")
        self._on_problem(request)
        return keel_pb2.LocalAck()


def serve(socket_path: str, service: AgentLocalService) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    keel_pb2_grpc.add_AgentLocalServicer_to_server(service, server)
    if server.add_insecure_port(f"unix:{socket_path}") == 0:
        raise OSError(f"cannot listen on unix socket {socket_path}")
    server.start()
    return server
