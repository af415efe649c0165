"""Restart in place, the rank's side: which errors end a generation under a rank that
can live on into the next one.

A rank keeps its process (its imports, its device context, whatever it built that does
not depend on the layout) across a generation change only when the generation ended
under it, not when it failed by itself: its own bug, an out-of-memory, a corrupted
device would follow it into the next generation, so those exit and the rank is
replaced by a fresh process. What ends a generation under a rank: a collective that
failed because a peer is gone or stuck (``torch.distributed``'s ``DistError`` family,
gloo's transport errors, a start barrier that peers missed), or the agent asking it
to leave (``GenerationEnded``). When in doubt it is not restartable: that costs time,
never correctness.
"""

from __future__ import annotations

import os
import socket
import sys

# Errors by class name, so that this module needs no torch: torch.distributed's own
# (DistBackendError, DistNetworkError, DistStoreError derive from DistError), and the
# start barrier's (trainer.watchdog).
_COLLECTIVE_ERRORS = frozenset(
    {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "StartBarrierError"}
)
# gloo reports a lost peer or a timed-out collective as a plain RuntimeError that names
# its own source file, e.g. "[.../gloo/transport/tcp/pair.cc:553] Connection closed by
# peer"; a monitored barrier names the ranks that failed to pass it.
_COLLECTIVE_MESSAGES = (
    "/gloo/",
    "monitoredBarrier",
    "Connection closed by peer",
    "Connection reset by peer",
)


class GenerationEnded(Exception):
    """Raised by a training loop to leave its generation because the agent asked
    (``Runtime.leave_requested``): the generation is being stopped and this rank can
    restart in place."""


def _causes(error: BaseException):
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        # DCP's CheckpointException carries each rank's error.
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [f for f in failures.values() if isinstance(f, BaseException)]


def ended_under_the_rank(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is the generation ending under this
    rank rather than the rank failing by itself (see the module's docstring)."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, MemoryError)):
        return False
    for cause in _causes(error):
        if isinstance(cause, GenerationEnded):
            return True
        if any(c.__name__ in _COLLECTIVE_ERRORS for c in type(cause).__mro__):
            return True
        if isinstance(cause, RuntimeError) and any(m in str(cause) for m in _COLLECTIVE_MESSAGES):
            return True
    return False


def _tcp_inodes() -> set[int]:
    """Inodes of the TCP sockets in this network namespace that are not listening."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)
                for row in rows:
                    columns = row.split()
                    # st 0A is LISTEN: gloo aborts the process if its listener fails.
                    if len(columns) > 9 and columns[3] != "0A":
                        found.add(int(columns[9]))
        except OSError:
            continue
    return found


def tcp_connections() -> dict[int, int]:
    """This process's connected TCP sockets: file descriptor → socket inode."""
    tcp = _tcp_inodes()
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in tcp:
            found[int(name)] = int(link[8:-1])
    return found


def sever(keep: set[int]) -> int:
    """Shuts down (both ways; the descriptors stay open for their owners to close)
    every connected TCP socket of this process whose inode is not in ``keep``; returns
    how many. A rank that lives on after its generation failed must do this: gloo keeps
    its connections to the peers open until the process group is freed, which a
    surviving process may never do, and a peer blocked on one of them would wait out
    its whole collective timeout."""
    severed = 0
    for fd, inode in tcp_connections().items():
        if inode in keep:
            continue
        try:
            if os.fstat(fd).st_ino != inode:  # closed and reused since it was listed
                continue
            connection = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            connection.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:
            pass
        finally:
            connection.detach()
    return severed


def torch_memory_released() -> None:
    """Frees what this process cached on its GPU, if torch is loaded and has one, so a
    parked process holds its context but not the last generation's memory."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
