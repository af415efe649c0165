"""Generation fences on a checkpoint directory: only the newest generation of a job may
commit, rename, clean up or delete in it.

A generation's rank 0 *claims* the directory before it touches anything there: it
writes its generation number, with its job's id, name and lineage (``common.lineage``:
a job never acts in a directory that holds another lineage's checkpoints, and rank 0
checks that before it claims), into ``.fence``, atomically (a temporary file, fsynced,
renamed, the directory fsynced), unless a newer generation already has. Every
destructive step of a generation then runs *held*: with an exclusive lock on
``.fence.lock`` and only while ``.fence`` still names that generation. An older
generation that runs on (its node was lost to the cluster, but not stopped: a stall,
a partition) finds a newer number there and is refused (``Superseded``): its commit,
its retention and its cleanup never land. The lock makes the check and the step one:
a claim waits until a step in progress is done. A step of a job whose fence another
job's claim has replaced (it took the directory over: it held none of this job's
checkpoints) is refused too (``ForeignLineage``).

The lock is taken with a deadline (``timeout_s``): a holder that never lets go (an old
rank 0 stopped, or stuck in uninterruptible I/O, inside a fenced step) must not block
every later generation's start without a word. Whoever holds the lock writes who it is
(``Holder``: pid, node, generation) over the start of ``.fence.lock``, so that a waiter
past its deadline raises ``FenceTimeout`` naming that process and node. The record is
padded to a fixed size and overwritten in place, so that a new holder's write needs no
free space; where it cannot be written at all (a full filesystem on the first lock
ever) the lock is held all the same and the holder is unknown.

``held`` with ``claim_after`` runs the body first and claims after it: the cleanup of
a full directory frees space before ``.fence`` is written, still under the lock and
after the owner is checked.

The lock is ``flock``: a shared filesystem must support it (NFSv4 and Lustre do, as
POSIX locks). Outside Keel (generation 0) there is no fence.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from trainer.runtime import Owner, read_owner

FENCE_FILE = ".fence"
LOCK_FILE = ".fence.lock"
# The holder's record fills this many bytes of the lock file (JSON padded with spaces):
# once the file has them, every later holder overwrites the same blocks.
HOLDER_BYTES = 256
# A waiter tries again after FIRST_POLL_S, doubling to at most MAX_POLL_S: a commit's
# rename holds the lock for milliseconds, a stalled holder for ever.
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.25


class Superseded(RuntimeError):
    """A newer generation owns the checkpoint directory; ``owner`` is its number."""

    def __init__(self, directory: str, generation: int, owner: int):
        super().__init__(
            f"generation {owner} owns {directory}; generation {generation} is "
            f"superseded and may not change anything there"
        )
        self.owner = owner


class ForeignLineage(Superseded):
    """Another job's lineage owns the checkpoint directory (``why`` says whose): nothing
    of this job may change anything there."""

    def __init__(self, why: str, owner: int = 0):
        RuntimeError.__init__(self, why)
        self.owner = owner


@dataclass(frozen=True)
class Holder:
    """Who holds a directory's fence lock: process ``pid`` on ``node`` (the node its
    agent names, "" outside Keel) for ``generation``. Stored over the start of the lock
    file; ``SCHEMA`` is its version."""

    pid: int
    node: str
    generation: int

    SCHEMA = 1

    def to_bytes(self) -> bytes:
        record = {
            "schema": self.SCHEMA,
            "pid": self.pid,
            "node": self.node,
            "generation": self.generation,
        }
        return json.dumps(record).encode().ljust(HOLDER_BYTES - 1) + b"\n"

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder ``data`` (the lock file's content) names; None where it names
        none that this version reads (empty, cut short, another schema)."""
        try:
            record = json.loads(data)
            if record["schema"] != cls.SCHEMA:
                return None
            return cls(int(record["pid"]), str(record["node"]), int(record["generation"]))
        except (ValueError, KeyError, TypeError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on node {self.node or '(unnamed)'} (generation {self.generation})"


class FenceTimeout(TimeoutError):
    """The fence lock of ``directory`` stayed held past ``timeout_s`` seconds;
    ``holder``: who held it, as it said (None: it did not say). ``pid`` and ``node``
    are the holder's (0 and "" when unknown). A TimeoutError: a deadline passed."""

    def __init__(self, directory: str, timeout_s: float, holder: Holder | None):
        who = str(holder) if holder else "a process that did not say who it is"
        super().__init__(
            f"the fence lock {os.path.join(directory, LOCK_FILE)} was held for over "
            f"{timeout_s:g} s by {who}: a rank of an older generation is stalled "
            f"(stopped, or in uninterruptible I/O) inside a step in the checkpoint "
            f"directory; end that process, or look at that node's storage"
        )
        self.directory = directory
        self.holder = holder
        self.pid = holder.pid if holder else 0
        self.node = holder.node if holder else ""


def owner(directory: str) -> int:
    """The generation that owns ``directory`` (0: none has claimed it)."""
    found = read_owner(directory)
    return found.generation if found is not None else 0


def holder(directory: str) -> Holder | None:
    """Who holds, or last held, ``directory``'s fence lock, as it wrote itself there
    (None: nobody said, or it cannot be read)."""
    try:
        # Opened anew each time: on NFS a fresh open sees what the holder fsynced.
        with open(os.path.join(directory, LOCK_FILE), "rb") as lock:
            return Holder.parse(lock.read(4 * HOLDER_BYTES))
    except OSError:
        return None  # unknown: the waiter's FenceTimeout says so


@contextlib.contextmanager
def _locked(directory: str, who: Holder, timeout_s: float) -> Iterator[None]:
    """Holds ``directory``'s fence lock as ``who``, taken within ``timeout_s`` seconds
    (else FenceTimeout)."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        _acquire(fd, directory, timeout_s)
        _say_who(fd, who)
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, directory: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pause_s = FIRST_POLL_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise FenceTimeout(directory, timeout_s, holder(directory))
        time.sleep(min(pause_s, left_s))
        pause_s = min(2 * pause_s, MAX_POLL_S)


def _say_who(fd: int, who: Holder) -> None:
    """Writes ``who`` over the lock file's start, fsynced (a waiter on another NFS
    client reads the server's copy). Who holds the lock is for a waiter's error message
    only: where it cannot be written (no space for the file's first blocks, an I/O
    error), the file is emptied, so that no waiter names an earlier holder, and the
    step goes on."""
    record = who.to_bytes()
    try:
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))
        os.fsync(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)


def claim(
    directory: str,
    generation: int,
    claimant: Owner | None = None,
    *,
    timeout_s: float,
    node: str = "",
) -> None:
    """Make ``generation`` the owner of ``directory``; raises Superseded if a newer one
    of the same lineage already is, FenceTimeout if the lock is not had within
    ``timeout_s`` seconds (``node``: this process's node, for another's FenceTimeout).
    ``claimant`` (of ``generation``) names the job (id, name, lineage) the fence
    records; a directory another job's fence names is taken over (its caller has checked
    with ``lineage_refusal`` that no checkpoint of that lineage is there). A no-op
    outside Keel (generation 0)."""
    if generation == 0:
        return
    with _locked(directory, Holder(os.getpid(), node, generation), timeout_s):
        _claim_locked(directory, generation, claimant, claimant.job_id if claimant else "")


def _check_owner(
    directory: str, generation: int, claimant: Owner | None, job_id: str
) -> Owner | None:
    """Raises unless ``generation`` of job ``job_id`` ("": outside the job checks) may
    act in ``directory``: Superseded if a newer generation of its lineage owns it,
    ForeignLineage if another job does (and ``claimant``, a claim that takes an empty
    directory over, is not given). Returns the fence's owner (None: no fence)."""
    current = read_owner(directory)
    if current is None:
        return None
    # Generations are numbered per job: against another job's fence (or, for a claim,
    # one from before fences named their job), only whether the directory may be taken
    # over counts. A step under a fence without a job id is judged by generation.
    if job_id and current.job_id != job_id and (claimant is not None or current.job_id):
        if claimant is None:
            raise ForeignLineage(
                f"{current.describe()} owns {directory} now; generation {generation} of "
                f"job id {job_id} may not change anything there",
                current.generation,
            )
    elif current.generation > generation:
        raise Superseded(directory, generation, current.generation)
    return current


def _claim_locked(directory: str, generation: int, claimant: Owner | None, job_id: str) -> None:
    """Claim the directory for ``generation`` of job ``job_id`` (see ``_check_owner``):
    ``claimant`` given, as its new owner, else keeping the job the fence names."""
    current = _check_owner(directory, generation, claimant, job_id)
    if current is not None and current.generation == generation:
        if claimant is None or current == claimant:
            return
    if claimant is not None:
        record = claimant
    elif current is not None:
        # A step of a generation that did not claim the directory first: the job the
        # fence names stays its owner.
        record = Owner(generation, current.job_id, current.job, current.lineage)
    else:
        record = Owner(generation)
    tmp = os.path.join(directory, f"{FENCE_FILE}.g{generation}.tmp")
    with open(tmp, "w") as out:
        out.write(record.to_json())
        out.flush()
        os.fsync(out.fileno())
    os.rename(tmp, os.path.join(directory, FENCE_FILE))
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(
    directory: str,
    generation: int,
    job_id: str = "",
    *,
    timeout_s: float,
    node: str = "",
    claim_after: bool = False,
    claimant: Owner | None = None,
) -> Iterator[None]:
    """Run the body as ``generation``'s destructive step in ``directory``: with the lock
    held (taken within ``timeout_s`` seconds, else FenceTimeout naming its holder;
    ``node``: this process's node, for another's FenceTimeout), and only if no newer
    generation owns the directory (else Superseded) and, given the job's ``job_id``, no
    other lineage does (else ForeignLineage). The directory is claimed for
    ``generation`` if it was not yet: before the body, or with ``claim_after`` after it,
    for ``claimant`` (the body must then write nothing that needs the claim: it frees
    space for it). Outside Keel (generation 0) the body just runs."""
    if generation == 0:
        yield
        return
    if claimant is not None:
        job_id = claimant.job_id
    with _locked(directory, Holder(os.getpid(), node, generation), timeout_s):
        if claim_after:
            _check_owner(directory, generation, claimant, job_id)
            yield
            _claim_locked(directory, generation, claimant, job_id)
        else:
            _claim_locked(directory, generation, claimant, job_id)
            yield
