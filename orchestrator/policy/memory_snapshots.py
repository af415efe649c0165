"""What the controller records of a job's memory snapshots (``trainer.memory_tier``):
which report replaces the record, which partner node holds a node's copy (and which
one replaces a partner that is lost), and what a new generation's placement does with
the snapshot: keeps it, brings a partner's copy to its node, or leaves it behind.
Pure: the controller passes the record it holds, the report or the placement, and
stores or deletes what this decides."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from common.records import MemorySnapshotRecord


def supersedes(
    held: MemorySnapshotRecord | None,
    generation: int,
    step: int,
    replica_step: int = 0,
    replica_node: str = "",
) -> bool:
    """Whether a snapshot of ``step`` committed by ``generation`` (with its copy of
    ``replica_step`` on partner ``replica_node``) replaces ``held``: a later
    generation's always (it removed the older snapshots when it committed its first,
    even of an earlier step: it restored from further back), the same generation's when
    it is of a later step, or of the same step with a newer copy (an earlier one is a
    replay), or the same copy on another partner (``with_replica``: the first partner
    was lost)."""
    if held is None or generation > held.generation:
        return True
    if generation < held.generation or step != held.step:
        return generation == held.generation and step > held.step
    if replica_step != held.replica_step:
        return replica_step > held.replica_step
    return replica_step > 0 and replica_node not in ("", held.replica_node)


def with_replica(
    held: MemorySnapshotRecord | None, generation: int, step: int, node: str
) -> MemorySnapshotRecord | None:
    """``held`` with its copy of ``step`` now whole on ``node`` (the partner that an
    agent of ``generation`` replicated it to), or None if the report changes nothing: a
    copy of another generation's, of a step the record has not reached (its snapshot
    report comes first), or older than the copy recorded. A copy of the step recorded
    on another node is taken: the partner was lost, and a new one given the newest
    snapshot (``repartnered``), which the lost one may have held already."""
    if held is None or generation != held.generation:
        return None
    if step > held.step or step < held.replica_step or node in held.nodes:
        return None
    if step == held.replica_step and node == held.replica_node:
        return None
    return replace(held, replica_step=step, replica_node=node)


def carried(held: MemorySnapshotRecord | None, new: MemorySnapshotRecord) -> MemorySnapshotRecord:
    """A newer snapshot's record ``new``, keeping the copy ``held`` recorded where it is
    of the same generation: the partner keeps its copy until a newer one replaces it,
    while the nodes keep only their newest snapshot."""
    if held is None or held.generation != new.generation or not held.replica_step:
        return new
    return replace(new, replica_step=held.replica_step, replica_node=held.replica_node)


@dataclass(frozen=True)
class Placed:
    """What a new generation's placement does with the memory snapshot recorded:
    ``keep`` the record (its nodes all run the generation), or drop it; ``copy``: the
    node whose copy the generation's one node brings into its memory before its ranks
    start, ``(node, step, holder)``; ``reason``: what to add to the generation's."""

    keep: bool
    copy: tuple[str, int, str] | None = None
    reason: str = ""


def placed(
    held: MemorySnapshotRecord | None,
    placement: Collection[str],
    alive: Collection[str],
    durable_step: int,
) -> Placed:
    """What a generation placed on ``placement`` does with ``held``, with ``alive`` the
    nodes whose agents are connected and ``durable_step`` the durable checkpoint it
    would restore (0: none). A snapshot is in the memory of the nodes that wrote it,
    each holding its own ranks' part; with one of them left out, the generation can
    restore it only from a partner's copy, and only a snapshot of one node on one node
    (copies of a job across nodes are not made): brought there from the partner (or
    found there, if the generation runs on the partner), if the copy is newer than the
    durable checkpoint. Else the record goes and the reason says what the generation
    restores instead."""
    if held is None:
        return Placed(keep=False)
    gone = sorted(set(held.nodes) - set(placement))
    if not gone:
        return Placed(keep=True)
    durable = f"step {durable_step}" if durable_step else "no durable checkpoint"
    lost = (
        f"the memory snapshot of step {held.step} was held by {', '.join(gone)}, which "
        "the new generation does not run on"
    )
    copy = f"its copy on {held.replica_node} (step {held.replica_step})"
    if len(held.nodes) > 1:
        why = "a snapshot of a job across nodes is not copied to partners"
    elif not held.replica_step:
        why = "no copy of it was replicated"
    elif held.replica_step <= durable_step:
        why = f"{copy} is no newer than the durable checkpoint"
    elif held.replica_node not in alive:
        why = f"{copy} was lost too"
    elif len(set(placement)) != 1 or len(held.nodes) != 1:
        why = (
            f"{copy} is restored on one node only, and the generation runs on {len(set(placement))}"
        )
    else:
        (target,) = set(placement)
        (source,) = held.nodes
        fetched = "which it runs on" if target == held.replica_node else f"fetched to {target}"
        # The partner may hold a later copy than the one reported: the newest it holds.
        later = " or later" if held.replica_step < held.step else ""
        return Placed(
            keep=False,
            copy=(source, held.replica_step, held.replica_node),
            reason=(
                f"{lost}: it restores the copy of step {held.replica_step}{later} on "
                f"{held.replica_node} ({fetched})"
            ),
        )
    return Placed(keep=False, reason=f"{lost}, and {why}: it restores from {durable}")


def partner(
    node: str,
    candidates: Mapping[str, str],
    placement: Collection[str],
    load: Mapping[str, int],
) -> str:
    """The node that ``node``'s memory snapshots are replicated to ("" if none can be):
    one of ``candidates`` (node → its failure domain, "" where not said: the nodes
    whose agents hold memory and are connected) other than ``node``, preferring, in
    order, one in another failure domain than ``node``'s when both say theirs, the
    fewest partnerships already (``load``: spread, so that no node holds every job's
    copies), then the name. None for a generation whose ``placement`` spans nodes:
    across nodes a snapshot is restored from the nodes that hold it, in the same
    layout, and a copy of one node's part restores nothing (``placed``)."""
    if len(set(placement)) > 1:
        return ""
    own = candidates.get(node, "")

    def rank(other: str) -> tuple:
        domain = candidates[other]
        return (bool(own and domain and domain == own), load.get(other, 0), other)

    others = [other for other in candidates if other != node]
    return min(others, key=rank) if others else ""


def repartnered(
    node: str,
    current: str,
    candidates: Mapping[str, str],
    placement: Collection[str],
    load: Mapping[str, int],
) -> str:
    """The partner a running generation's ``node`` copies its snapshots to from now
    on, where ``current`` (its partner so far) is no longer one of ``candidates`` (the
    nodes that hold memory and count: ``partner``'s): another, chosen as at the start
    (``partner``); "" where the current one still serves, or none other can. Without
    it, losing the partner lost every later snapshot's copy: the node's loss then
    restored the durable checkpoint, however many spares held memory."""
    if current in candidates:
        return ""
    return partner(node, candidates, placement, load)
