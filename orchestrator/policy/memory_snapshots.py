"""What the controller records of a job's memory snapshots (``trainer.memory_tier``):
which report replaces the record, and when a new generation's placement leaves the
snapshot behind. Pure: the controller passes the record it holds, the report or the
placement, and stores or deletes what this decides."""

from __future__ import annotations

from collections.abc import Collection

from common.records import MemorySnapshotRecord


def supersedes(held: MemorySnapshotRecord | None, generation: int, step: int) -> bool:
    """Whether a snapshot of ``step`` committed by ``generation`` replaces ``held``:
    a later generation's always (it removed the older snapshots when it committed its
    first, even of an earlier step: it restored from further back), the same
    generation's when it is of a later step (an earlier one is a replay)."""
    if held is None or generation > held.generation:
        return True
    return generation == held.generation and step > held.step


def left_behind(held: MemorySnapshotRecord | None, placement: Collection[str]) -> list[str]:
    """The nodes holding ``held`` that a generation placed on ``placement`` does not
    run on, sorted: a snapshot is in the memory of the nodes that wrote it only, so
    with any of them gone no rank can restore it, and the generation restores from
    the durable checkpoint. Empty: the snapshot stays restorable (or there is none)."""
    if held is None:
        return []
    return sorted(set(held.nodes) - set(placement))
