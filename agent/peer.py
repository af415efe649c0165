"""Copies of memory snapshots between agents (the ``AgentPeer`` service of
``protos/keel.proto``): a node's committed snapshot replicated to its partner node's
agent, which holds it in its own memory, and fetched back agent to agent by the node
that restores it when the node that wrote it is gone.

A node's own snapshots are the trainer's (``ROOT/<job_id>/mem_<step:08d>/``,
``trainer.memory_tier``; ROOT is ``agent.memory.JobMemory``'s). What an agent holds for
OTHER nodes lives beside them, ``ROOT/.replicas/<job_id>/<node>/mem_<step:08d>/``, with
the same files::

    .replicas/job-7/node-3/
        mem_00000041/                  committed: node-3's snapshot of step 41, whole
        .incoming-42-k2j4_x/           being received; never read, removed if cut

A copy is committed whole or not at all: it is written into a staging directory and
renamed to its committed name only once the stream's last message (the one naming
every file and its size) matches what arrived; a stream cut, refused or failed on the
memory (ENOSPC) leaves nothing. One copy is kept per (job, node): the newest; a copy of
an older step than the one held is refused. What this agent holds for other nodes is
bounded by its replica budget (``Replicas``), apart from the memory of its own jobs.

Sending (``snapshot_chunks``) opens every file of a snapshot before it sends a byte,
so that a copy the trainer, or a newer replica, removes meanwhile is still read whole:
an open file keeps its unlinked inode. ``Replicator`` sends a node's newest committed
snapshot to its partner in the background, at most at a given rate so that it leaves
the network to training.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from agent.memory import held_bytes
from common import rpc
from common.call_bounds import KIB, MIB, RequestLimits
from common.node_identity import peer_name
from common.tls import TlsFiles
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger("agent.peer")

REPLICAS = ".replicas"
CHUNK_BYTES = 1 * MIB
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SNAPSHOT_FILE = re.compile(r"\.metadata|snapshot\.json|__\d+\.(mem|obj)")
COMMITTED = re.compile(r"mem_(\d+)")
INCOMING = ".incoming-"  # a copy being received
REPLACED = ".replaced-"  # a copy of the same step, removed once the new one is in place

SERVICE = "/keel.v1.AgentPeer/"
PEER_LIMITS = RequestLimits(
    per_method={
        # A streaming method's messages are bounded by the server's receive limit only
        # (common.call_bounds), the largest of this table: a chunk's CHUNK_BYTES of data
        # and its names, or the last message's map of the node's files (two per rank).
        SERVICE + "PutSnapshot": CHUNK_BYTES + 64 * KIB,
    },
    # GetSnapshot's request names a job, a node and a step.
    default_bytes=4 * KIB,
)
# Calls served at once, per worker thread: a stream holds a worker for as long as it
# runs, and one more call per worker waits for one; gRPC refuses the next, unread.
CALLS_PER_WORKER = 2
CLOSE_WAIT_S = 5.0  # how long Replicator.close waits for its thread
# A copy to the partner fails past SEND_FLOOR_S plus four times what its bytes take at
# the rate bound (at UNBOUNDED_FLOOR_BYTES_PER_S where there is none): a partner that
# stalls (a frozen host's kernel still takes the connection, and keepalives do not
# end a stream blocked on its flow control) holds up the copies only that long.
SEND_FLOOR_S = 5.0
UNBOUNDED_FLOOR_BYTES_PER_S = 100e6


class PeerRefusal(Exception):
    """Why this agent refuses a copy or a call: the gRPC status ``code`` to answer and a
    ``message`` that says what is wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class PeerError(Exception):
    """A copy to or from another agent failed: ``message`` says why, with the peer's
    own words where it answered; ``code``, its gRPC status (None: it never answered)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        self.code = code


class PeerTimeout(PeerError, TimeoutError):
    """A copy to or from another agent ran past its deadline."""


def snapshot_name(step: int) -> str:
    """The committed name of a snapshot's directory, as ``trainer.memory_tier`` names
    it: ``mem_00000041``."""
    return f"mem_{step:08d}"


def check_name(what: str, value: str) -> None:
    """Refuses (INVALID_ARGUMENT) a job id or node name that is not path-safe."""
    if not NAME.fullmatch(value):
        raise PeerRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} {value!r}: 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or a digit",
        )


def check_file(name: str) -> None:
    """Refuses (INVALID_ARGUMENT) a name that is not one of a snapshot's files."""
    if not SNAPSHOT_FILE.fullmatch(name):
        raise PeerRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"file {name!r}: a memory snapshot holds only .metadata, snapshot.json and "
            "__<rank>.mem / __<rank>.obj",
        )


def _committed(directory: Path) -> dict[int, Path]:
    """The committed copies in a (job, node) directory, by step."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        match = COMMITTED.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


def _write_chunks(
    chunks: Iterable[keel_pb2.SnapshotChunk],
    staging: Path,
    job_id: str,
    node: str,
    step: int,
    on_bytes: Callable[[int], None],
) -> int:
    """Writes a stream of a snapshot's chunks into ``staging``, each at its offset, and
    checks the last message (the one with ``files``) against what arrived: every file
    it names is there with exactly that size, and no other was written. Every chunk
    must name ``job_id``, ``node`` and ``step``. ``on_bytes(total)``: told the bytes
    the files span so far each time they grow (it raises to stop the stream). The
    bytes of the snapshot; raises PeerRefusal, or OSError from the memory."""
    ends: dict[str, int] = {}
    fds: dict[str, int] = {}
    total = 0
    files: dict[str, int] | None = None
    try:
        for chunk in chunks:
            if files is not None:
                raise PeerRefusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "a message after the last one (the one naming every file)",
                )
            if (chunk.job_id, chunk.node, chunk.step) != (job_id, node, step):
                raise PeerRefusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a chunk of job {chunk.job_id!r}, node {chunk.node!r}, step "
                    f"{chunk.step} in a stream of job {job_id!r}, node {node!r}, step "
                    f"{step}: every chunk of a stream names the same snapshot",
                )
            if not chunk.file and not chunk.files:
                raise PeerRefusal(
                    grpc.StatusCode.INVALID_ARGUMENT, "a chunk that names no file and no files"
                )
            if chunk.file:
                check_file(chunk.file)
                end = chunk.offset + len(chunk.data)
                previous = ends.get(chunk.file, 0)
                ends[chunk.file] = max(previous, end)
                if end > previous:
                    total += end - previous
                    on_bytes(total)
                if chunk.file not in fds:
                    fds[chunk.file] = os.open(
                        staging / chunk.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
                    )
                try:
                    os.pwrite(fds[chunk.file], chunk.data, chunk.offset)
                except OverflowError:
                    raise PeerRefusal(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"file {chunk.file!r}: offset {chunk.offset} is past any file's end",
                    ) from None
            if chunk.files:
                files = dict(chunk.files)
    finally:
        for fd in fds.values():
            os.close(fd)
    if files is None:
        raise PeerRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the stream ended before its last message (the one naming every file and its "
            "size): the copy is not whole",
        )
    for name in files:
        check_file(name)
    unnamed = sorted(set(ends) - set(files))
    if unnamed:
        raise PeerRefusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"files sent but not named in the last message: {', '.join(unnamed)}",
        )
    for name, size in sorted(files.items()):
        if name not in ends:
            raise PeerRefusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"file {name!r}: named with {size} bytes in the last message, never sent",
            )
        arrived = os.stat(staging / name).st_size
        if arrived != size:
            raise PeerRefusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"file {name!r}: {arrived} bytes arrived, the last message says {size}",
            )
    return sum(files.values())


class Replicas:
    """The copies of memory snapshots this agent holds for other nodes, under
    ``root/.replicas/<job_id>/<node>/mem_<step:08d>/`` (``root``: the memory root of
    ``agent.memory.JobMemory``), at most ``budget_bytes`` of them in all, counting the
    copies being received (0: no bound). Safe to use from the server's threads.

    Made when the agent starts: copies a previous agent committed are kept (a restore
    may still want them), the staging directories of copies it was receiving are
    removed."""

    def __init__(self, root: Path, budget_bytes: int):
        self.root = root
        self.dir = root / REPLICAS
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        # Bytes of the committed copies, per (job_id, node), and of each stream being
        # received (by its staging directory): the budget is checked on every chunk.
        self._held: dict[tuple[str, str], int] = {}
        self._receiving: dict[Path, int] = {}
        self._scan()

    def _scan(self) -> None:
        """Counts the committed copies on disk and removes what a previous agent left
        half done: copies being received, copies being replaced."""
        for node in self.dir.glob("*/*"):
            if not node.is_dir():
                continue
            for entry in node.iterdir():
                if entry.name.startswith((INCOMING, REPLACED)):
                    shutil.rmtree(entry, ignore_errors=True)
            size = sum(held_bytes(path) for path in _committed(node).values())
            if size:
                self._held[(node.parent.name, node.name)] = size

    def _node_dir(self, job_id: str, node: str) -> Path:
        check_name("job_id", job_id)
        check_name("node", node)
        return self.dir / job_id / node

    def held(self, job_id: str, node: str) -> tuple[int, Path] | None:
        """The newest committed copy of ``node``'s snapshot of job ``job_id``: its step
        and directory; None if none is held. Raises PeerRefusal for a bad name."""
        copies = _committed(self._node_dir(job_id, node))
        if not copies:
            return None
        step = max(copies)
        return step, copies[step]

    def receive(self, chunks: Iterable[keel_pb2.SnapshotChunk]) -> int:
        """Takes a copy of a snapshot from a stream of its chunks (``PutSnapshot``) and
        commits it whole, replacing the copy held of that (job, node); the bytes of the
        copy. Raises PeerRefusal, with nothing of the copy left behind, if any chunk
        is refused, the stream ends before its last message, the copy is older than
        the one held, the budget would be exceeded or the memory fails (ENOSPC:
        RESOURCE_EXHAUSTED)."""
        job_id = node = step = None
        staging = None
        try:
            stream = iter(chunks)
            first = next(stream, None)
            if first is None:
                raise PeerRefusal(grpc.StatusCode.INVALID_ARGUMENT, "an empty stream: no chunk")
            job_id, node, step = first.job_id, first.node, first.step
            parent = self._node_dir(job_id, node)
            if step == 0:
                raise PeerRefusal(
                    grpc.StatusCode.INVALID_ARGUMENT, "step: the snapshot's step, from 1"
                )
            self._check_newer(job_id, node, step)
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{INCOMING}{step}-", dir=parent))
            with self._lock:
                self._receiving[staging] = 0
            size = _write_chunks(
                itertools.chain([first], stream),
                staging,
                job_id,
                node,
                step,
                lambda total: self._within_budget(job_id, node, staging, total),
            )
            self._commit(job_id, node, step, staging, size)
            staging = None
        except PeerRefusal as refusal:
            log.warning(
                "memory snapshot copy refused",
                job_id=job_id,
                of_node=node,
                step=step,
                error=refusal.message,
            )
            raise
        except OSError as error:
            log.warning(
                "memory snapshot copy not kept",
                job_id=job_id,
                of_node=node,
                step=step,
                error=str(error),
            )
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            raise PeerRefusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.INTERNAL,
                f"the copy could not be written here: {error}",
            ) from error
        except grpc.RpcError as error:
            log.warning("memory snapshot copy cut", job_id=job_id, of_node=node, step=step)
            raise PeerRefusal(
                grpc.StatusCode.CANCELLED, "the stream was cut before its last message"
            ) from error
        finally:
            if staging is not None:
                with self._lock:
                    self._receiving.pop(staging, None)
                shutil.rmtree(staging, ignore_errors=True)
        log.info(
            "memory snapshot copy received", job_id=job_id, of_node=node, step=step, bytes=size
        )
        return size

    def _check_newer(self, job_id: str, node: str, step: int) -> None:
        held = self.held(job_id, node)
        if held is not None and step < held[0]:
            raise PeerRefusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {step} of node {node}'s snapshot of job {job_id} is older than the "
                f"copy held (step {held[0]})",
            )

    def _within_budget(self, job_id: str, node: str, staging: Path, total: int) -> None:
        """Records that the copy being received in ``staging`` spans ``total`` bytes,
        or refuses it if that and every other copy held or being received (but those
        of the same (job, node), which it replaces) are over the budget."""
        with self._lock:
            self._receiving[staging] = total
            if not self.budget_bytes:
                return
            others = sum(size for key, size in self._held.items() if key != (job_id, node))
            others += sum(size for path, size in self._receiving.items() if path != staging)
        if others + total > self.budget_bytes:
            raise PeerRefusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a copy of {total}+ bytes, with the {others} bytes held or being received for "
                f"other nodes, is over this agent's replica budget of {self.budget_bytes} bytes",
            )

    def _commit(self, job_id: str, node: str, step: int, staging: Path, size: int) -> None:
        """Renames ``staging`` to its committed name and removes the copies it replaces."""
        with self._lock:
            self._check_newer(job_id, node, step)
            target = staging.parent / snapshot_name(step)
            replaced = None
            if target.exists():
                replaced = staging.parent / f"{REPLACED}{step}-{secrets.token_hex(4)}"
                os.rename(target, replaced)
            os.rename(staging, target)
            self._held[(job_id, node)] = size
            self._receiving.pop(staging, None)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        for older, path in _committed(staging.parent).items():
            if older < step:
                shutil.rmtree(path, ignore_errors=True)

    def release(self, job_id: str, why: str) -> int:
        """Removes every copy held for job ``job_id`` (it has ended); the bytes they
        held."""
        check_name("job_id", job_id)
        path = self.dir / job_id
        with self._lock:
            if not path.is_dir():
                return 0
            size = held_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            for key in [key for key in self._held if key[0] == job_id]:
                del self._held[key]
        log.info("replicas released", job_id=job_id, bytes=size, reason=why)
        return size

    def take(self, job_id: str, node: str, step: int, into: Path) -> int | None:
        """Moves the copy held of ``node``'s snapshot of job ``job_id``, if it is of
        ``step`` or later (a later one may have arrived since ``step``'s was reported),
        into the directory ``into`` under its committed name (a rename: on the same file
        system); its step, or None if no such copy is held. Raises OSError if the
        rename fails."""
        parent = self._node_dir(job_id, node)
        with self._lock:
            copies = _committed(parent)
            newest = max(copies, default=0)
            if newest < step or not copies:
                return None
            os.rename(copies[newest], into / snapshot_name(newest))
            left = sum(held_bytes(path) for path in _committed(parent).values())
            if left:
                self._held[(job_id, node)] = left
            else:
                self._held.pop((job_id, node), None)
        return newest


class _Pace:
    """A token bucket of at most one chunk: ``wait(n)`` returns once ``n`` more bytes
    keep the stream at most ``rate_bytes_per_s`` (0: at once). It starts empty, so that
    N bytes take at least N / rate seconds."""

    def __init__(self, rate_bytes_per_s: float):
        self.rate = rate_bytes_per_s
        self.tokens = 0.0
        self.at = time.monotonic()

    def wait(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.tokens = min(float(max(n, CHUNK_BYTES)), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < n:
            time.sleep((n - self.tokens) / self.rate)
            self.tokens, self.at = float(n), time.monotonic()
        self.tokens -= n


def _open_snapshot(directory: Path) -> list[tuple[str, int, int]]:
    """Every file of the snapshot in ``directory``, opened: (name, fd, size). Raises
    OSError if the directory is gone or unreadable, or holds a file that is not one
    of a snapshot's."""
    opened: list[tuple[str, int, int]] = []
    try:
        for name in sorted(os.listdir(directory)):
            if not SNAPSHOT_FILE.fullmatch(name):
                raise OSError(
                    errno.EINVAL,
                    "not a file of a memory snapshot (.metadata, snapshot.json, "
                    "__<rank>.mem, __<rank>.obj)",
                    str(directory / name),
                )
            fd = os.open(directory / name, os.O_RDONLY)
            opened.append((name, fd, os.fstat(fd).st_size))
    except BaseException:
        for _, fd, _ in opened:
            os.close(fd)
        raise
    return opened


def _chunks(
    job_id: str,
    node: str,
    step: int,
    opened: list[tuple[str, int, int]],
    rate_bytes_per_s: float,
) -> Iterator[keel_pb2.SnapshotChunk]:
    pace = _Pace(rate_bytes_per_s)
    try:
        for name, fd, size in opened:
            offset = 0
            while True:
                data = os.pread(fd, min(CHUNK_BYTES, size - offset), offset)
                pace.wait(len(data))
                yield keel_pb2.SnapshotChunk(
                    job_id=job_id, node=node, step=step, file=name, offset=offset, data=data
                )
                offset += len(data)
                # An empty file is still sent, as one empty chunk, so that it is there.
                if offset >= size or not data:
                    break
        files = {name: size for name, _, size in opened}
        yield keel_pb2.SnapshotChunk(job_id=job_id, node=node, step=step, files=files)
    finally:
        for _, fd, _ in opened:
            os.close(fd)


def snapshot_chunks(
    job_id: str, node: str, step: int, directory: Path, rate_bytes_per_s: float = 0
) -> Iterator[keel_pb2.SnapshotChunk]:
    """The chunks that carry the snapshot in ``directory`` (``node``'s, of ``step`` of
    job ``job_id``): each file in chunks of at most ``CHUNK_BYTES``, then the last
    message naming every file and its size, paced to at most ``rate_bytes_per_s``
    (0: unbounded). Every file is opened here, before the first chunk: raises OSError
    if the directory is gone or unreadable."""
    return _chunks(job_id, node, step, _open_snapshot(directory), rate_bytes_per_s)


class PeerService(keel_pb2_grpc.AgentPeerServicer):
    """The ``AgentPeer`` service over this agent's ``replicas``."""

    def __init__(self, replicas: Replicas):
        self.replicas = replicas

    def PutSnapshot(self, request_iterator, context):
        try:
            size = self.replicas.receive(request_iterator)
        except PeerRefusal as refusal:
            context.abort(refusal.code, refusal.message)
        return keel_pb2.SnapshotReceived(bytes=size)

    def GetSnapshot(self, request, context):
        job_id, node, step = request.job_id, request.node, request.step
        try:
            held = self.replicas.held(job_id, node)
        except PeerRefusal as refusal:
            context.abort(refusal.code, refusal.message)
        if held is None or held[0] < step:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no copy of node {node}'s memory snapshot of step {step} or later of job "
                f"{job_id} is held here: "
                + (f"the copy held is of step {held[0]}" if held else "none of that node's is"),
            )
        step = held[0]
        try:
            chunks = snapshot_chunks(job_id, node, step, held[1])
        except FileNotFoundError:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"the copy of node {node}'s memory snapshot of step {step} of job {job_id} "
                "was replaced or taken meanwhile",
            )
        except OSError as error:
            context.abort(grpc.StatusCode.INTERNAL, f"the copy held cannot be read: {error}")
        yield from chunks


def serve(
    listen: str, tls: TlsFiles | None, replicas: Replicas, workers: int = 4
) -> tuple[grpc.Server, int]:
    """Serves the ``AgentPeer`` service over ``replicas`` on ``listen`` (host:port;
    port 0 picks one), with mutual TLS (plaintext if ``tls`` is None), each call held to
    ``PEER_LIMITS``; ``workers``: calls served at once. The started server and its
    port; raises OSError if it cannot listen."""
    server = rpc.server(workers, PEER_LIMITS, CALLS_PER_WORKER * workers)
    keel_pb2_grpc.add_AgentPeerServicer_to_server(PeerService(replicas), server)
    port = rpc.add_port(server, listen, tls)
    if port == 0:
        raise OSError(f"cannot listen on {listen} for the agent peer service")
    server.start()
    return server, port


def _channel(address: str, tls: TlsFiles | None, node: str) -> grpc.Channel:
    """A channel to node ``node``'s agent at ``address``: with mutual TLS, its
    certificate must name it (``peer_name``), whatever the address."""
    options = rpc.CHANNEL_OPTIONS
    if tls is not None and node:
        options = [*options, ("grpc.ssl_target_name_override", peer_name(node))]
    return rpc.channel(address, tls, options)


def _peer_error(address: str, what: str, error: grpc.RpcError) -> PeerError:
    code = error.code()
    message = f"{what} {address}: {code.name}: {error.details()}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return PeerTimeout(message, code)
    return PeerError(message, code)


def _put(
    channel: grpc.Channel,
    address: str,
    chunks: Iterator[keel_pb2.SnapshotChunk],
    timeout_s: float,
    started: Callable[[grpc.Future], None],
) -> tuple[int, float]:
    """Sends ``chunks`` over ``channel`` to the agent at ``address`` (``PutSnapshot``),
    within ``timeout_s``; ``started(call)`` is given the call, to cancel it. The bytes
    it took and the seconds the send took; raises PeerError."""
    start = time.monotonic()
    call = keel_pb2_grpc.AgentPeerStub(channel).PutSnapshot.future(chunks, timeout=timeout_s)
    started(call)
    try:
        reply = call.result()
    except grpc.FutureCancelledError:
        raise PeerError(f"the send to {address} was cancelled", grpc.StatusCode.CANCELLED) from None
    except grpc.RpcError as error:
        raise _peer_error(address, "sending a memory snapshot to", error) from error
    return reply.bytes, time.monotonic() - start


def send_snapshot(
    address: str,
    tls: TlsFiles | None,
    job_id: str,
    node: str,
    step: int,
    directory: Path,
    rate_bytes_per_s: float,
    timeout_s: float,
    peer: str = "",
) -> tuple[int, float]:
    """Sends the snapshot in ``directory`` (``node``'s of ``step`` of job ``job_id``)
    to the agent of node ``peer`` at ``address`` to hold (with mutual TLS its
    certificate must name ``peer``), at most at ``rate_bytes_per_s`` (0: unbounded),
    within ``timeout_s``. The bytes the peer took and the seconds the send took; raises
    PeerError with the peer's message (PeerTimeout past the deadline), or if the
    snapshot cannot be read."""
    try:
        chunks = snapshot_chunks(job_id, node, step, directory, rate_bytes_per_s)
    except OSError as error:
        raise PeerError(f"the snapshot in {directory} cannot be read: {error}") from error
    with _channel(address, tls, peer) as channel:
        return _put(channel, address, chunks, timeout_s, lambda call: None)


def fetch_snapshot(
    address: str,
    tls: TlsFiles | None,
    job_id: str,
    node: str,
    step: int,
    into: Path,
    timeout_s: float,
    holder: str = "",
) -> tuple[int, int]:
    """Fetches the copy of ``node``'s snapshot of job ``job_id`` that the agent of node
    ``holder`` at ``address`` holds (with mutual TLS its certificate must name
    ``holder``), of ``step`` or later (the newest it holds: a later one may have arrived
    since ``step``'s was reported), into the directory ``into`` under its committed
    name, whole or not at all, within ``timeout_s``; its step and bytes. Raises
    PeerError (the peer's NOT_FOUND names the step it holds) and leaves nothing
    behind."""
    wanted = keel_pb2.SnapshotWanted(job_id=job_id, node=node, step=step)
    staging = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=into))
        with _channel(address, tls, holder) as channel:
            stream = keel_pb2_grpc.AgentPeerStub(channel).GetSnapshot(wanted, timeout=timeout_s)
            first = next(stream, None)
            if first is None or first.step < step:
                raise PeerRefusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"it sent step {first.step}, not {step} or later"
                    if first
                    else "it sent nothing",
                )
            got = first.step
            chunks = itertools.chain([first], stream)
            size = _write_chunks(chunks, staging, job_id, node, got, lambda total: None)
        os.rename(staging, into / snapshot_name(got))
        staging = None
    except grpc.RpcError as error:
        raise _peer_error(address, "fetching a memory snapshot from", error) from error
    except PeerRefusal as refusal:
        raise PeerError(f"the copy {address} sent is refused: {refusal.message}") from refusal
    except OSError as error:
        raise PeerError(f"the copy from {address} cannot be written to {into}: {error}") from error
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return got, size


@dataclass(frozen=True)
class _Offer:
    job_id: str
    step: int
    directory: Path
    partner_node: str
    partner_address: str


class Replicator:
    """Sends this node's (``node``'s) newest committed snapshot to its partner's agent,
    on one background thread, at most at ``rate_bytes_per_s`` (0: unbounded), each send
    within ``timeout_s``. The newest offer wins: while a send is in flight only the
    newest offer waits, and older ones are dropped. ``on_replicated(job_id, step,
    partner_node, bytes, seconds)`` is called from that thread after each send that
    succeeds. ``sent_bytes``, ``sent_s``: the totals of the sends that succeeded. A send
    fails past ``deadline_s`` of its bytes: a stalled partner holds the copies up no
    longer, and the next newest is tried when it fails."""

    def __init__(
        self,
        node: str,
        tls: TlsFiles | None,
        rate_bytes_per_s: float,
        on_replicated: Callable[[str, int, str, int, float], None],
        timeout_s: float = 300,
    ):
        self.node = node
        self.tls = tls
        self.rate_bytes_per_s = rate_bytes_per_s
        self.on_replicated = on_replicated
        self.timeout_s = timeout_s
        self.sent_bytes = 0
        self.sent_s = 0.0
        self._wake = threading.Condition()
        self._waiting: _Offer | None = None
        self._call: grpc.Future | None = None
        self._closed = False
        self._failing: set[str] = set()  # partners whose last send failed, warned of once
        # The channel to the partner of the last send, kept while sends to it succeed:
        # ((address, node), channel). One that failed goes (a fresh one reconnects at
        # once, where a failed one may be backing off).
        self._channel: tuple[tuple[str, str], grpc.Channel] | None = None
        self._thread = threading.Thread(target=self._run, name="replicator", daemon=True)
        self._thread.start()

    def offer(
        self, job_id: str, step: int, directory: Path, partner_node: str, partner_address: str
    ) -> None:
        """The snapshot of ``step`` in ``directory`` is committed: send it to
        ``partner_node`` at ``partner_address`` once the send in flight is done (unless
        a newer one is offered before)."""
        with self._wake:
            self._waiting = _Offer(job_id, step, directory, partner_node, partner_address)
            self._wake.notify()

    def close(self) -> None:
        """Stops the thread, cancelling a send in flight; waits at most
        ``CLOSE_WAIT_S``."""
        with self._wake:
            self._closed = True
            self._waiting = None
            if self._call is not None:
                self._call.cancel()
            self._wake.notify()
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._drop_channel()

    def _channel_to(self, address: str, node: str) -> grpc.Channel:
        """The channel to ``node``'s agent at ``address``: the one kept, if it is to
        them; else a new one, kept instead."""
        if self._channel is not None and self._channel[0] == (address, node):
            return self._channel[1]
        self._drop_channel()
        channel = _channel(address, self.tls, node)
        self._channel = ((address, node), channel)
        return channel

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel[1].close()
            self._channel = None

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._waiting is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                offer, self._waiting = self._waiting, None
            self._send(offer)

    def _started(self, call: grpc.Future) -> None:
        with self._wake:
            self._call = call
            if self._closed:
                call.cancel()

    def deadline_s(self, size: int) -> float:
        """How long a copy of ``size`` bytes may take (``SEND_FLOOR_S``), at most
        ``timeout_s``."""
        rate = self.rate_bytes_per_s or UNBOUNDED_FLOOR_BYTES_PER_S
        return min(self.timeout_s, SEND_FLOOR_S + 4 * size / rate)

    def _send(self, offer: _Offer) -> None:
        fields = dict(job_id=offer.job_id, step=offer.step, partner=offer.partner_node)
        try:
            opened = _open_snapshot(offer.directory)
            chunks = _chunks(offer.job_id, self.node, offer.step, opened, self.rate_bytes_per_s)
        except FileNotFoundError:
            # The trainer removes a snapshot once a newer one commits: that one is next.
            log.debug("memory snapshot gone before it was replicated", **fields)
            return
        except OSError as error:
            self._failed(offer, f"the snapshot in {offer.directory} cannot be read: {error}")
            return
        try:
            size, seconds = _put(
                self._channel_to(offer.partner_address, offer.partner_node),
                offer.partner_address,
                chunks,
                self.deadline_s(sum(size for _, _, size in opened)),
                self._started,
            )
        except PeerError as error:
            self._drop_channel()
            if not self._closed:
                self._failed(offer, error.message)
            return
        finally:
            with self._wake:
                self._call = None
        self.sent_bytes += size
        self.sent_s += seconds
        if offer.partner_node in self._failing:
            self._failing.discard(offer.partner_node)
            log.info("memory snapshots replicated again", **fields)
        log.debug("memory snapshot replicated", bytes=size, seconds=round(seconds, 3), **fields)
        try:
            self.on_replicated(offer.job_id, offer.step, offer.partner_node, size, seconds)
        except Exception:
            # The thread outlives a failing callback: the next snapshot is still sent.
            log.exception("a replicated snapshot could not be reported", **fields)

    def _failed(self, offer: _Offer, error: str) -> None:
        """Warns of a failed send, once until a send to that partner succeeds again."""
        if offer.partner_node in self._failing:
            return
        self._failing.add(offer.partner_node)
        log.warning(
            "memory snapshot not replicated",
            job_id=offer.job_id,
            step=offer.step,
            partner=offer.partner_node,
            error=error,
        )
