"""Ranks' output, read through the controller from whichever node ran them
(``ReadLog``): ``keel logs JOB`` shows one rank's, ``keel run`` streams every rank's.

A rank's stdout goes to this process's stdout and its stderr to stderr, as under
torchrun; with a prefix (``[rank3]:``, torchrun's) at the start of every line when
several ranks share the terminal.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import click
import grpc

from orchestrator.cli.operator import Client, connection_options
from orchestrator.policy.lifecycle import WIRE_STATES
from protos import keel_pb2

FOLLOW_POLL_S = 0.5
# Reads of one rank per pull before the others get their turn (each up to 64 KiB of
# each stream).
READS_PER_PULL = 16


@dataclass
class _Cursor:
    out: int = 0  # bytes of each stream read so far
    err: int = 0
    # The tail of each stream after its last newline, held until the line ends.
    pending: dict[str, bytes] = field(default_factory=lambda: {"out": b"", "err": b""})
    running: bool = True
    node: str = ""


class RankOutput:
    """Copies ranks' output to this terminal as it grows. ``call`` is a
    ``ControllerClient.call``; its ``grpc.RpcError`` is what ``pull`` raises."""

    def __init__(self, call, job: str, prefix: bool):
        self.call = call
        self.job = job
        self.prefix = prefix
        self.cursors: dict[tuple[int, int], _Cursor] = {}
        self.sinks = {"out": sys.stdout.buffer, "err": sys.stderr.buffer}

    def pull(self, generation: int, rank: int) -> _Cursor:
        """Copy what ``rank`` of ``generation`` wrote since the last pull; returns its
        cursor (``running``: whether the rank still runs)."""
        cursor = self.cursors.setdefault((generation, rank), _Cursor())
        for _ in range(READS_PER_PULL):
            reply = self.call(
                "ReadLog",
                keel_pb2.ReadLogRequest(
                    job=self.job,
                    generation=generation,
                    rank=rank,
                    out_offset=cursor.out,
                    err_offset=cursor.err,
                ),
            )
            cursor.running, cursor.node = reply.running, reply.node
            if reply.out_offset < cursor.out or reply.err_offset < cursor.err:
                cursor.out = cursor.err = 0  # the files were replaced: start again
            cursor.out, cursor.err = reply.out_offset, reply.err_offset
            self._write(rank, cursor, "out", reply.out)
            self._write(rank, cursor, "err", reply.err)
            if not reply.out and not reply.err:
                break
        return cursor

    def _write(self, rank: int, cursor: _Cursor, stream: str, data: bytes) -> None:
        if not data:
            return
        sink = self.sinks[stream]
        if not self.prefix:
            sink.write(data)
            sink.flush()
            return
        text = cursor.pending[stream] + data
        *lines, cursor.pending[stream] = text.split(b"\n")
        if lines:
            sink.write(b"".join(_prefixed(rank, line) for line in lines))
            sink.flush()

    def finish(self, generation: int, rank: int) -> None:
        """Write what is held of ``rank``'s unfinished last lines."""
        cursor = self.cursors.get((generation, rank))
        if cursor is None or not self.prefix:
            return
        for stream, tail in cursor.pending.items():
            if tail:
                self.sinks[stream].write(_prefixed(rank, tail))
                self.sinks[stream].flush()
                cursor.pending[stream] = b""


def _prefixed(rank: int, line: bytes) -> bytes:
    """``[rankN]:line``; a line torch already prefixed so (its tracebacks) as it is."""
    prefix = b"[rank%d]:" % rank
    return (line if line.startswith(prefix) else prefix + line) + b"\n"


def _last_words(output: RankOutput, generation: int, rank: int) -> None:
    """What the rank wrote since the last read, if its node still answers (a node lost
    with its generation keeps its output to itself; following goes on without it)."""
    try:
        output.pull(generation, rank)
    except grpc.RpcError as err:
        click.echo(
            f"keel logs: the end of generation {generation}'s output: {_rpc_problem(err)}", err=True
        )


def _rpc_problem(err: grpc.RpcError) -> str:
    return f"{err.code().name}: {err.details()}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("job")
@click.option("--rank", type=int, default=0, show_default=True, help="Whose output.")
@click.option(
    "--generation",
    type=int,
    default=0,
    help="Of this generation (default: the current or last one; with -f, each "
    "new generation's in turn).",
)
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Keep printing as the rank writes, into the generations after it, until the job ends.",
)
@connection_options(with_json=False)
def logs(job, rank, generation, follow, controller, etcd_endpoints, token_file, **security):
    """Print a rank's output (stdout to stdout, stderr to stderr), read from the node
    that ran it through the controller."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    output = RankOutput(client.client.call, job, prefix=False)
    status = client.call("GetJob", keel_pb2.GetJobRequest(job=job))
    current = generation or status.generation
    said = ""
    while True:
        try:
            cursor = output.pull(current, rank)
        except grpc.RpcError as err:
            # Following: a rank not started yet, or a node out of reach for now, is
            # waited for (said once); anything else, or either without -f, ends it.
            waitable = err.code() in (
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION,
            )
            if not (follow and waitable) or WIRE_STATES.from_wire(status.state).terminal:
                raise click.ClickException(_rpc_problem(err)) from None
            if err.details() != said:
                said = err.details()
                click.echo(f"keel logs: {said}; waiting", err=True)
            cursor = None
        if not follow:
            return
        status = client.call("GetJob", keel_pb2.GetJobRequest(job=job))
        if not generation and status.generation > current:
            if cursor is not None:
                _last_words(output, current, rank)  # then the next generation's
            current = status.generation
            click.echo(f"--- {job} generation {current} ---", err=True)
            continue
        if (
            WIRE_STATES.from_wire(status.state).terminal
            and cursor is not None
            and not cursor.running
        ):
            _last_words(output, current, rank)
            return
        time.sleep(FOLLOW_POLL_S)
