"""Rank placement: which node runs which ranks of a generation. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeRanks:
    node: str
    ranks: tuple[int, ...]  # global ranks, contiguous

    @property
    def local_world_size(self) -> int:
        return len(self.ranks)


def free_slots(nodes: Iterable[tuple[str, int]], busy: Set[str], cap: int) -> dict[str, int]:
    """The slots a job may be placed on: each of ``nodes`` (name, slots; the usable
    ones) that is not ``busy`` (cordoned, held by another job, or kept off), at most
    ``cap`` each (the job's ranks per node, torchrun's --nproc-per-node; 0: no cap)."""
    return {name: min(slots, cap) if cap else slots for name, slots in nodes if name not in busy}


class NotEnoughSlots(ValueError):
    pass


def place(world_size: int, free_slots: dict[str, int]) -> list[NodeRanks]:
    """Fill nodes in name order with contiguous ranks, using as few nodes as possible.

    ``free_slots`` maps node name to its free slots. Node order is by name so that a
    plan is reproducible from the same membership; rank 0 lands on the first node.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    total = sum(free_slots.values())
    if total < world_size:
        raise NotEnoughSlots(f"{total}/{world_size} slots free, need {world_size}")
    # Largest nodes first keeps the rank count per node even on uniform clusters and
    # uses the fewest nodes otherwise; ties break by name.
    order = sorted((n for n, s in free_slots.items() if s > 0), key=lambda n: (-free_slots[n], n))
    placed, next_rank = [], 0
    for node in order:
        if next_rank == world_size:
            break
        take = min(free_slots[node], world_size - next_rank)
        placed.append(NodeRanks(node, tuple(range(next_rank, next_rank + take))))
        next_rank += take
    return placed
