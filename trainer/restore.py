"""Which checkpoint a generation restores: the newest one that is whole.

Under Keel the controller decides the candidates: its restore point
(``KEEL_RESTORE_FROM``, the newest checkpoint it recorded) and, behind it, older
recorded ones (``KEEL_RESTORE_FALLBACKS``); none means a fresh start, even if an
unrecorded ``step_*`` directory exists. Under plain torchrun the candidates are the
committed ``step_*`` directories, newest first.

Rank 0 verifies each candidate in turn against its manifest (``trainer.manifest``):
one that is missing or damaged is *quarantined* (renamed aside to
``.quarantine.step_N.gG``, kept for a person to look at, never loaded again) and
reported to the agent, whose controller marks its record; the first that verifies is
loaded by every rank. If there were candidates and none verifies, the restore fails
rather than start over silently.
"""

from __future__ import annotations

import os
import re

import torch.distributed as dist

from trainer import fence, manifest
from trainer.checkpoint_dir import committed_steps
from trainer.runtime import Runtime, inside

_STEP = re.compile(r"step_(\d{8,})$")


class NothingToRestore(RuntimeError):
    """Every candidate checkpoint failed verification."""


def candidates(checkpoint_dir: str | None, runtime: Runtime) -> list[str]:
    """The checkpoints to try, in order: the restore point named (and its fallbacks) if
    one is; none under Keel without one; else every committed one, newest first."""
    if runtime.restore_from or runtime.job:
        return [p for p in (runtime.restore_from, *runtime.restore_fallbacks) if p]
    if not checkpoint_dir:
        return []
    found = committed_steps(checkpoint_dir)
    return [found[step] for step in sorted(found, reverse=True)]


def quarantine(
    checkpoint_dir: str, path: str, generation: int, *, fence_timeout_s: float, node: str = ""
) -> str | None:
    """Rename ``path`` aside so it is never loaded again; the new name, or None if there
    was nothing to rename. Held under the generation's fence (its lock taken within
    ``fence_timeout_s``; ``node``: this rank's)."""
    match = _STEP.search(os.path.basename(os.path.normpath(path)))
    if not match or not os.path.isdir(path):
        return None
    aside = os.path.join(checkpoint_dir, f".quarantine.step_{match.group(1)}.g{generation}")
    with fence.held(checkpoint_dir, generation, timeout_s=fence_timeout_s, node=node):
        os.rename(path, aside)
    return aside


def _outside(path: str, checkpoint_dir: str | None) -> str:
    """Why ``path`` may not be restored from: a checkpoint is loaded (and DCP unpickles
    it) only from inside the job's checkpoint directory; "" if it is inside (or the job
    names no directory: outside Keel)."""
    if checkpoint_dir and not inside(path, checkpoint_dir):
        return f"it is not inside the job's checkpoint directory {checkpoint_dir}"
    return ""


def choose(checkpoint_dir: str | None, runtime: Runtime) -> str | None:
    """The checkpoint every rank loads (None: a fresh start). Collective: rank 0
    verifies and quarantines, then broadcasts its choice. Raises NothingToRestore."""
    decided: list = [None, [], False]
    if dist.get_rank() == 0:
        tried = candidates(checkpoint_dir, runtime)
        chosen, problems = None, []
        for path in tried:
            outside = _outside(path, checkpoint_dir)
            problem = outside or manifest.verify(path)
            if not problem:
                chosen = path
                break
            problems.append(f"{path}: {problem}")
            # What lies outside the job's directory is not the job's to rename.
            aside = (
                None
                if outside
                else quarantine(
                    checkpoint_dir or os.path.dirname(path),
                    path,
                    runtime.generation,
                    fence_timeout_s=runtime.fence_timeout_s,
                    node=runtime.node,
                )
            )
            runtime.log(
                f"quarantined checkpoint {path}: {problem}"
                + (f"; moved to {aside}" if aside else "")
            )
            match = _STEP.search(os.path.basename(os.path.normpath(path)))
            runtime.report_checkpoint_problem(
                int(match.group(1)) if match else 0, path, "quarantined", problem
            )
        decided = [chosen, problems, bool(tried)]
    dist.broadcast_object_list(decided, src=0)
    chosen, problems, had_candidates = decided
    if chosen is None and had_candidates:
        raise NothingToRestore("no checkpoint can be restored: " + "; ".join(problems))
    return chosen
