"""Which checkpoint a generation restores: the newest one that is whole.

Under Keel the controller decides the candidates: its restore point
(``KEEL_RESTORE_FROM``, the newest checkpoint it recorded) and, behind it, older
recorded ones (``KEEL_RESTORE_FALLBACKS``). A job that has recorded none may start a
new lineage from another's checkpoint (``KEEL_RESUME_FROM``: a committed checkpoint, or
a checkpoint directory, whose committed ones are tried newest first); with neither it
starts fresh, even if an unrecorded ``step_*`` directory exists. Under plain torchrun
the candidates are the committed ``step_*`` directories, newest first.

Every rank verifies its share of each candidate in turn (``trainer.verify.check``):

- whole (``ok``), or written without a manifest but with DCP metadata that holds
  (``unverified``, loaded with a warning): every rank loads it;
- proven damaged (a size or checksum mismatch, unreadable DCP metadata): one of the
  job's own is *quarantined* (renamed aside to ``.quarantine.step_N.gG``, kept for a
  person to look at, never loaded again) and reported, and its record is marked; a
  resume source is another lineage's and is never changed;
- unreachable (its directory missing or unreadable on some node: a mount absent, an
  I/O error): a problem of that node, not of the checkpoint, which is left alone and
  reported so that the controller suspects the node; the next candidate is tried.

If there were candidates and none could be restored, the restore fails (never a
silent fresh start): ``CheckpointUnreachable`` if any was unreachable (another node
may read it), else ``NothingToRestore``, each listing every candidate and why.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from trainer import fence, memory_tier, verify
from trainer.checkpoint_dir import committed_steps
from trainer.runtime import Runtime, inside
from trainer.verify import VerdictKind

_STEP = re.compile(r"step_(\d{8,})$")


class NothingToRestore(RuntimeError):
    """Every candidate checkpoint failed verification."""


class CheckpointUnreachable(NothingToRestore):
    """No candidate could be restored, and some could not be read on some node."""


@dataclass(frozen=True)
class Restored:
    """The checkpoint every rank loads: its ``path``; ``lineage``, the job ids its
    manifest names, origin first (empty for one written without a manifest or before
    manifests named them); ``resumed``: it is another lineage's (``KEEL_RESUME_FROM``)."""

    path: str
    lineage: tuple[str, ...]
    resumed: bool
    memory: bool = False  # a memory snapshot (``trainer.memory_tier``), not a checkpoint


def _step_of(path: str) -> int:
    match = _STEP.search(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else 0


def resume_candidates(source: str) -> list[str]:
    """A resume source's checkpoints to try, newest first: the source itself if it is
    one checkpoint (it holds DCP's ``.metadata`` or a manifest, or is named
    ``step_N``), else the committed ones in it. Raises OSError if it cannot be read."""
    if (
        _STEP.search(os.path.basename(os.path.normpath(source)))
        or os.path.isfile(os.path.join(source, ".metadata"))
        or os.path.isfile(os.path.join(source, "manifest.json"))
    ):
        return [source]
    os.listdir(source)  # a source that is not there is this node's problem: say so
    found = committed_steps(source)
    return [found[step] for step in sorted(found, reverse=True)]


def candidates(checkpoint_dir: str | None, runtime: Runtime) -> tuple[list[str], bool]:
    """The checkpoints to try, in order, and whether they are a resume source (another
    lineage's, read-only): the restore point named (and its fallbacks) if one is; else
    the resume source if one is named; none under Keel without either; else (plain
    torchrun) every committed one, newest first."""
    own = [p for p in (runtime.restore_from, *runtime.restore_fallbacks) if p]
    if own:
        return own, False
    if runtime.resume_from:
        return resume_candidates(runtime.resume_from), True
    if runtime.job or not checkpoint_dir:
        return [], False
    found = committed_steps(checkpoint_dir)
    return [found[step] for step in sorted(found, reverse=True)], False


def quarantine(checkpoint_dir: str, path: str, runtime: Runtime) -> str | None:
    """Rename ``path`` aside so it is never loaded again; the new name, or None if there
    was nothing to rename. Held under the generation's fence (its lock taken within
    ``runtime.fence_timeout_s``)."""
    match = _STEP.search(os.path.basename(os.path.normpath(path)))
    if not match or not os.path.isdir(path):
        return None
    aside = os.path.join(checkpoint_dir, f".quarantine.step_{match.group(1)}.g{runtime.generation}")
    with fence.held(
        checkpoint_dir,
        runtime.generation,
        runtime.job_id,
        timeout_s=runtime.fence_timeout_s,
        node=runtime.node,
    ):
        os.rename(path, aside)
    return aside


def _outside(path: str, checkpoint_dir: str | None) -> str:
    """Why ``path`` may not be restored from: a checkpoint of the job's own is loaded
    (and DCP unpickles it) only from inside the job's checkpoint directory; "" if it is
    inside (or the job names no directory: outside Keel)."""
    if checkpoint_dir and not inside(path, checkpoint_dir):
        return f"it is not inside the job's checkpoint directory {checkpoint_dir}"
    return ""


def _listed(checkpoint_dir: str | None, runtime: Runtime) -> tuple[list[str], bool, str]:
    """Rank 0's candidates (see ``candidates``), and why it could not list them."""
    try:
        tried, resumed = candidates(checkpoint_dir, runtime)
    except OSError as exc:
        where = exc.filename or runtime.resume_from or checkpoint_dir
        return [], True, f"{where}: cannot be read here: {exc.strerror or exc}"
    return tried, resumed, ""


def choose(
    checkpoint_dir: str | None,
    runtime: Runtime,
    memory: bool = False,
    reads: Callable[[Metadata], set[str]] | None = None,
) -> Restored | None:
    """The checkpoint every rank loads (None: a fresh start). Collective: rank 0 lists
    the candidates; with ``memory`` (the memory tier is on) the newest memory snapshot
    every rank's node holds, with every file the rank ``reads`` of it, is taken if it is
    newer than the first of them (``memory_tier.choose``); else every rank verifies its
    share of each; rank 0 quarantines and reports. Raises NothingToRestore (or
    CheckpointUnreachable)."""
    listed: list = [[], False, ""]
    if dist.get_rank() == 0:
        listed = list(_listed(checkpoint_dir, runtime))
    dist.broadcast_object_list(listed, src=0)
    tried, resumed, unlisted = listed
    if memory:
        snapshot = memory_tier.choose(runtime, _step_of(tried[0]) if tried else 0, reads)
        if snapshot is not None:
            if dist.get_rank() == 0:
                durable = f"the durable checkpoint {tried[0]}" if tried else "no durable checkpoint"
                runtime.log(
                    f"restoring the memory snapshot of step {snapshot.info.step}, newer than "
                    f"{durable}"
                )
            return Restored(snapshot.path, snapshot.info.lineage, resumed=False, memory=True)
    problems = [unlisted] if unlisted else []
    unreachable = bool(unlisted)
    if unlisted and dist.get_rank() == 0:
        runtime.log(f"cannot list the checkpoints to resume from: {unlisted}")
        runtime.report_checkpoint_problem(0, runtime.resume_from or "", "unreachable", unlisted)
    for path in tried:
        outside = "" if resumed else _outside(path, checkpoint_dir)
        verdict = None if outside else verify.check(path, runtime.node)
        if verdict is not None and verdict.kind in (VerdictKind.OK, VerdictKind.UNVERIFIED):
            if dist.get_rank() == 0 and verdict.kind is VerdictKind.UNVERIFIED:
                runtime.log(f"restoring {path} without a checksum manifest: {verdict.reason}")
            owners = verdict.manifest.lineage if verdict.manifest else ()
            if not owners and verdict.manifest and verdict.manifest.job_id:
                owners = (verdict.manifest.job_id,)
            return Restored(path, tuple(owners), resumed)
        reason = outside or verdict.reason
        problems.append(f"{path}: {reason}")
        if dist.get_rank() != 0:
            continue
        if verdict is not None and verdict.kind is VerdictKind.UNREACHABLE:
            unreachable = True
            runtime.log(f"cannot read checkpoint {path} here; leaving it as it is: {reason}")
            # The node that could not read it (the lowest rank's) is the suspect.
            runtime.report_checkpoint_problem(
                _step_of(path),
                path,
                "unreachable",
                reason,
                suspect_node=(verdict.nodes or ("",))[0],
            )
        elif resumed or outside:
            # Another lineage's, or outside the job's directory: not the job's to rename.
            runtime.log(f"cannot restore checkpoint {path}: {reason}")
        else:
            aside = quarantine(checkpoint_dir or os.path.dirname(path), path, runtime)
            runtime.log(
                f"quarantined checkpoint {path}: {reason}"
                + (f"; moved to {aside}" if aside else "")
            )
            runtime.report_checkpoint_problem(_step_of(path), path, "quarantined", reason)
    if not tried and not resumed:
        return None
    where = f" to resume from in {runtime.resume_from}" if resumed else ""
    message = f"no verifiable checkpoint{where}: " + "; ".join(problems or ["it holds none"])
    if unreachable:
        raise CheckpointUnreachable(message)
    raise NothingToRestore(message)
