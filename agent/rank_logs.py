"""Reading a rank's output for the controller (``keel logs``, ``keel run``): the
``.out`` and ``.err`` files the supervisor writes, from the offsets asked, bounded."""

from __future__ import annotations

from pathlib import Path

from agent.supervisor import rank_log
from common.keys import JOB_NAME
from protos import keel_pb2

MAX_BYTES = 1 << 20  # of each file per read: well inside gRPC's 4 MiB message
DEFAULT_BYTES = 64 << 10


def _read(path: Path, offset: int, limit: int) -> tuple[bytes, int]:
    """Up to ``limit`` bytes of ``path`` from ``offset`` and the offset after them; an
    offset past the end (the file was replaced) reads from 0."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if offset > size:
            offset = 0
        handle.seek(offset)
        data = handle.read(limit)
    return data, offset + len(data)


def read(run_dir: Path, node: str, request: keel_pb2.ReadLog, running: bool) -> keel_pb2.LogChunk:
    """The chunk answering ``request``; its ``error`` says what could not be read."""
    chunk = keel_pb2.LogChunk(request_id=request.request_id, running=running)
    if not JOB_NAME.match(request.job):
        chunk.error = f"job name {request.job!r} is not one Keel gives a job"
        return chunk
    out = rank_log(run_dir, request.job, request.generation, request.rank, "out")
    chunk.path = str(out)
    limit = min(request.max_bytes or DEFAULT_BYTES, MAX_BYTES)
    try:
        chunk.out, chunk.out_offset = _read(out, request.out_offset, limit)
        chunk.err, chunk.err_offset = _read(out.with_suffix(".err"), request.err_offset, limit)
    except FileNotFoundError:
        chunk.error = (
            f"node {node} has no output of rank {request.rank} of job "
            f"{request.job} generation {request.generation} (no {out})"
        )
    except OSError as exc:
        chunk.error = f"node {node} cannot read {out}: {exc}"
    return chunk
