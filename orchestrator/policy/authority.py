"""What an agent may tell the controller: only facts about ranks its node hosts in
the job's current generation. The join token admits a node to the cluster; it does
not let the node speak for other nodes' ranks, record a checkpoint outside the job's
checkpoint directory (a restore loads it, and DCP unpickles), or move a job backwards.
Pure: each check returns why a message is refused, or "".
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeAuthority:
    """What the plan lets ``node`` speak for in one job's current generation."""

    node: str
    generation: int
    ranks: frozenset[int]  # the generation's ranks planned on the node
    commits: bool  # the node hosts rank 0, the one that commits
    checkpoint_dir: str  # the job's ("" if it has none)


def rank_refusal(authority: NodeAuthority, rank: int) -> str:
    if rank not in authority.ranks:
        return (
            f"{authority.node} reported rank {rank} of generation {authority.generation}, "
            f"which it does not host (its ranks: {sorted(authority.ranks)})"
        )
    return ""


def checkpoint_refusal(authority: NodeAuthority, step: int, path: str) -> str:
    """A commit is recorded only from rank 0's node, at a step of at least 1, for a
    directory inside the job's checkpoint directory."""
    if not authority.commits:
        return (
            f"{authority.node} reported a checkpoint commit, but rank 0 of generation "
            f"{authority.generation} (the committing rank) is not on it"
        )
    if step < 1:
        return f"{authority.node} reported a checkpoint of step {step}: steps count from 1"
    if not within(path, authority.checkpoint_dir):
        where = authority.checkpoint_dir or "nowhere (the job has no checkpoint_dir)"
        return (
            f"{authority.node} reported a checkpoint at {path!r}, outside the job's "
            f"checkpoint directory {where}"
        )
    return ""


def rendezvous_taken(starting: bool, first_node: str, node: str, port: int) -> bool:
    """Whether a rendezvous endpoint ``node`` reports is the generation's: the job is
    being started, the node hosts the placement's first part (rank 0), and the port is
    one (a late report of an earlier attempt, or of another node, is passed over)."""
    return starting and bool(first_node) and node == first_node and 0 < port < 65536


def within(path: str, directory: str) -> bool:
    """Whether absolute ``path`` names something strictly inside ``directory``, by its
    normalized text (the controller may not see the filesystem; the ranks resolve
    symbolic links when they restore)."""
    if not directory or not path.startswith("/") or "\0" in path:
        return False
    root = posixpath.normpath(directory)
    return posixpath.normpath(path).startswith(root.rstrip("/") + "/")
