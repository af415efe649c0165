"""Generation fences on a checkpoint directory: only the newest generation of a job may
commit, rename, clean up or delete in it.

A generation's rank 0 *claims* the directory before it touches anything there: it
writes its generation number into ``.fence``, atomically (a temporary file, fsynced,
renamed, the directory fsynced), unless a newer generation already has. Every
destructive step of a generation then runs *held*: with an exclusive lock on
``.fence.lock`` and only while ``.fence`` still names that generation. An older
generation that runs on (its node was lost to the cluster, but not stopped: a stall,
a partition) finds a newer number there and is refused (``Superseded``): its commit,
its retention and its cleanup never land. The lock makes the check and the step one:
a claim waits until a step in progress is done.

The lock is ``flock``: a shared filesystem must support it (NFSv4 and Lustre do, as
POSIX locks). Outside Keel (generation 0) there is no fence.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator

FENCE_FILE = ".fence"
LOCK_FILE = ".fence.lock"


class Superseded(RuntimeError):
    """A newer generation owns the checkpoint directory; ``owner`` is its number."""

    def __init__(self, directory: str, generation: int, owner: int):
        super().__init__(
            f"generation {owner} owns {directory}; generation {generation} is "
            f"superseded and may not change anything there"
        )
        self.owner = owner


def owner(directory: str) -> int:
    """The generation that owns ``directory`` (0: none has claimed it)."""
    try:
        with open(os.path.join(directory, FENCE_FILE)) as fence:
            return int(json.load(fence)["generation"])
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def claim(directory: str, generation: int) -> None:
    """Make ``generation`` the owner of ``directory``; raises Superseded if a newer one
    already is. A no-op outside Keel (generation 0)."""
    if generation == 0:
        return
    with _locked(directory):
        _claim_locked(directory, generation)


def _claim_locked(directory: str, generation: int) -> None:
    current = owner(directory)
    if current > generation:
        raise Superseded(directory, generation, current)
    if current == generation:
        return
    tmp = os.path.join(directory, f"{FENCE_FILE}.g{generation}.tmp")
    with open(tmp, "w") as out:
        json.dump({"generation": generation}, out)
        out.flush()
        os.fsync(out.fileno())
    os.rename(tmp, os.path.join(directory, FENCE_FILE))
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(directory: str, generation: int) -> Iterator[None]:
    """Run the body as ``generation``'s destructive step in ``directory``: with the lock
    held, and only if no newer generation owns the directory (else Superseded; the
    directory is claimed for ``generation`` if it was not yet). Outside Keel
    (generation 0) the body just runs."""
    if generation == 0:
        yield
        return
    with _locked(directory):
        _claim_locked(directory, generation)
        yield
