"""The next generation's restore point and what it says of the nodes it left behind.
Pure: the controller passes the job's checkpoint records and its nodes before and
after placement, and persists and reports what these return."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.records import CheckpointRecord
from orchestrator.policy.event_kind import EventKind

# Older recorded checkpoints a generation may fall back to if its restore point fails
# verification.
RESTORE_FALLBACKS = 3


@dataclass(frozen=True)
class RestorePoint:
    """What a generation restores: ``path`` ("" for a fresh start) of ``step``, then
    ``fallbacks`` (paths, newest first) if it fails verification."""

    path: str = ""
    step: int | None = None
    fallbacks: tuple[str, ...] = ()


def restore_point(records: Iterable[CheckpointRecord]) -> RestorePoint:
    """The newest recorded checkpoint that is not quarantined, with up to
    RESTORE_FALLBACKS older good ones to fall back to; ``records`` oldest first."""
    good = [r for r in records if not r.quarantined]
    if not good:
        return RestorePoint()
    older = tuple(r.path for r in reversed(good[:-1]))[:RESTORE_FALLBACKS]
    return RestorePoint(good[-1].path, good[-1].step, older)


def unrestorable(records: Iterable[CheckpointRecord]) -> str:
    """Why the job cannot go on from its checkpoints ("" if it can, or never recorded
    one): it recorded some and every one failed verification since, each listed with
    why; ``records`` oldest first."""
    records = list(records)
    if not records or any(not r.quarantined for r in records):
        return ""
    listed = "; ".join(
        f"step {r.step} ({r.path}): {r.quarantine_reason or 'failed verification'}"
        for r in reversed(records)
    )
    return f"no verifiable checkpoint: {listed}"


@dataclass(frozen=True)
class NodesLeft:
    """Nodes the new generation runs without (``out``, sorted), and how: REPLACED
    (newcomers took their ranks, at the same layout) or EXCLUDED (re-planned without
    them), the event that says so."""

    how: EventKind
    out: tuple[str, ...]
    reason: str


def nodes_left(
    before: frozenset[str],
    after: frozenset[str],
    leaving: frozenset[str],
    shrunk: bool,
    mesh: str,
    world_size: int,
) -> NodesLeft | None:
    """What the new generation (on ``after``) did with the nodes of the last one
    (``before``) that were leaving it (lost, suspected or replaced); None when it
    left none behind (a suspect used again is not out). Nodes new to the job, at the
    same layout, replaced them; otherwise they were excluded."""
    out = tuple(sorted((leaving & before) - after))
    if not out:
        return None
    newcomers = sorted(after - before)
    if newcomers and not shrunk:
        return NodesLeft(
            EventKind.REPLACED, out, f"{', '.join(out)} replaced by {', '.join(newcomers)}"
        )
    return NodesLeft(
        EventKind.EXCLUDED,
        out,
        f"{', '.join(out)} excluded; re-planned to {mesh} at world size {world_size}",
    )
