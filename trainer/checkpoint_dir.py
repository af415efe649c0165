"""The checkpoint directory's layout (see ``trainer.checkpoint``): where a step is
committed and staged, which steps are committed, what retention removes, the cleanup
of what a crash left, and the fsyncs that make entries durable."""

from __future__ import annotations

import os
import re
import shutil

from trainer import fence

METADATA_FILE = ".metadata"
_COMMITTED = re.compile(r"step_(\d{8,})")


def committed_path(checkpoint_dir: str, step: int) -> str:
    """The directory of step ``step``'s committed checkpoint."""
    return os.path.join(checkpoint_dir, f"step_{step:08d}")


def staging_path(checkpoint_dir: str, step: int, generation: int) -> str:
    """The directory generation ``generation`` writes step ``step`` into before commit."""
    return os.path.join(checkpoint_dir, f".step_{step:08d}.g{generation}.tmp")


def committed_steps(checkpoint_dir: str) -> dict[int, str]:
    """Step → path of every ``step_*`` directory under ``checkpoint_dir`` that holds DCP
    metadata."""
    if not os.path.isdir(checkpoint_dir):
        return {}
    found = {}
    for name in os.listdir(checkpoint_dir):
        match = _COMMITTED.fullmatch(name)
        path = os.path.join(checkpoint_dir, name)
        if match and os.path.isfile(os.path.join(path, METADATA_FILE)):
            found[int(match.group(1))] = path
    return found


def expired(steps: list[int], keep: int, protected: set[int]) -> list[int]:
    """The committed checkpoints (by step) that retention deletes: all but the newest
    ``keep`` and those in ``protected`` (the one this run restored from, the one just
    committed). ``keep`` 0 keeps everything. Pure."""
    if keep <= 0:
        return []
    newest = set(sorted(steps, reverse=True)[:keep])
    return sorted(step for step in steps if step not in newest and step not in protected)


def discard_staging(
    checkpoint_dir: str | None,
    generation: int,
    claimant: fence.Owner | None = None,
    *,
    fence_timeout_s: float,
    node: str = "",
) -> list[str]:
    """Removes every staging directory (``.step_*.tmp``) left by ranks that died while
    saving or deleting, or by a generation superseded since, and claims
    ``checkpoint_dir`` for ``generation`` (``trainer.fence``; ``claimant``: the job, id
    and lineage its fence is to name); returns what it removed. Call it on rank 0
    before training starts, once its lineage was checked (``trainer.lineage``).

    Fenced, and in this order: the lock taken, the owner checked, the leftovers
    removed, and only then ``.fence`` written, so that a filesystem that leftovers
    filled gets its space back before anything is written there. Raises
    fence.Superseded if a newer generation owns the directory, fence.FenceTimeout if
    the lock stays held past ``fence_timeout_s`` seconds (``node``: this rank's node,
    for a waiter's FenceTimeout)."""
    if not checkpoint_dir:
        return []
    removed = []
    with fence.held(
        checkpoint_dir,
        generation,
        timeout_s=fence_timeout_s,
        node=node,
        claim_after=True,
        claimant=claimant,
    ):
        # Outside Keel there is no lock to create the directory, and a first run has
        # never saved there.
        if os.path.isdir(checkpoint_dir):
            for name in sorted(os.listdir(checkpoint_dir)):
                if name.startswith(".step_") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
                    removed.append(name)
    return removed


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
