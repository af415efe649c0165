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

The lock is ``flock``: a shared filesystem must support it (NFSv4 and Lustre do, as
POSIX locks). Outside Keel (generation 0) there is no fence.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from trainer.runtime import Owner, read_owner

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


class ForeignLineage(Superseded):
    """Another job's lineage owns the checkpoint directory (``why`` says whose): nothing
    of this job may change anything there."""

    def __init__(self, why: str, owner: int = 0):
        RuntimeError.__init__(self, why)
        self.owner = owner


def owner(directory: str) -> int:
    """The generation that owns ``directory`` (0: none has claimed it)."""
    found = read_owner(directory)
    return found.generation if found is not None else 0


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def claim(directory: str, generation: int, claimant: Owner | None = None) -> None:
    """Make ``generation`` the owner of ``directory``; raises Superseded if a newer one
    of the same lineage already is. ``claimant`` (of ``generation``) names the job (id,
    name, lineage) the fence records; a directory another job's fence names is taken
    over (its caller has checked with ``lineage_refusal`` that no checkpoint of that
    lineage is there). A no-op outside Keel (generation 0)."""
    if generation == 0:
        return
    with _locked(directory):
        _claim_locked(directory, generation, claimant, claimant.job_id if claimant else "")


def _claim_locked(directory: str, generation: int, claimant: Owner | None, job_id: str) -> None:
    """Claim the directory for ``generation`` of job ``job_id`` ("": outside the job
    checks); ``claimant`` given, as its new owner (taking another lineage's empty
    directory over), else keeping the job the fence names."""
    current = read_owner(directory)
    takeover = claimant is not None
    # Generations are numbered per job: against another job's fence (or, for a claim,
    # one from before fences named their job), only whether the directory may be taken
    # over counts. A step under a fence without a job id is judged by generation.
    foreign = current is not None and job_id and current.job_id != job_id
    if foreign and (takeover or current.job_id):
        if not takeover:
            raise ForeignLineage(
                f"{current.describe()} owns {directory} now; generation {generation} of "
                f"job id {job_id} may not change anything there",
                current.generation,
            )
    elif current is not None and current.generation > generation:
        raise Superseded(directory, generation, current.generation)
    elif current is not None and current.generation == generation:
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
def held(directory: str, generation: int, job_id: str = "") -> Iterator[None]:
    """Run the body as ``generation``'s destructive step in ``directory``: with the lock
    held, and only if no newer generation owns the directory (else Superseded; the
    directory is claimed for ``generation`` if it was not yet) and, given the job's
    ``job_id``, no other lineage does (else ForeignLineage). Outside Keel (generation 0)
    the body just runs."""
    if generation == 0:
        yield
        return
    with _locked(directory):
        _claim_locked(directory, generation, None, job_id)
        yield
