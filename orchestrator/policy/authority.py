"""What an agent may tell the controller: only facts about ranks its node hosts in
the job's current generation. The join token admits a node to the cluster; it does
not let the node speak for other nodes' ranks, record a checkpoint anywhere but at
the committed path of its step in the job's checkpoint directory (a restore loads
it, and DCP unpickles), record one past the job's step, or move a job backwards.
Pure: each check returns why a message is refused, or "".
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from common.keys import NODE_NAME
from common.wire_kinds import CheckpointProblemKind

# Problems that change what the job does (what the next generation restores, where it
# runs, whether it can go on): only the current generation's rank 0, which verifies
# the restore point, claims the checkpoint directory and takes the fence, may report
# them.
RANK_ZERO_PROBLEMS = frozenset(
    {
        CheckpointProblemKind.QUARANTINED,
        CheckpointProblemKind.UNREACHABLE,
        CheckpointProblemKind.FENCE_TIMEOUT,
        CheckpointProblemKind.FOREIGN_LINEAGE,
    }
)


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


@dataclass(frozen=True)
class CommitBounds:
    """How far a commit of the job's current generation may go, as the controller
    knows it (steps count from 1)."""

    recorded_step: int  # the newest commit recorded, or queued to be (0: none)
    reported_step: int  # rank 0's newest step reported in the generation (its restore
    # point's until it reports one)
    target_steps: int  # the spec's step target (0: none)


def checkpoint_refusal(authority: NodeAuthority, bounds: CommitBounds, step: int, path: str) -> str:
    """A commit is recorded only from rank 0's node, at a step of at least 1, at the
    committed path of that step in the job's checkpoint directory, and no further than
    the job has come. A commit at or below ``bounds.recorded_step`` is not refused: it
    is a replay (an agent replays its newest commit after every Hello, and a stream's
    queued messages follow the replay), which changes nothing.

    Why a commit may not pass rank 0's reported step: rank 0 reports step N (flagged
    ``checkpointing``, sent at once) before its save of N begins, and its commit
    report first flushes its pending step reports (``trainer.runtime.reporting``);
    its agent sends the step reports it holds before the commit
    (``agent.daemon._on_event_checkpoint``) on the one stream, and a replay sends
    each rank's latest step before the newest commit. So the controller hears of
    step N before the commit of N. The one honest exception is a rank 0 that dropped
    step reports while its agent did not answer them: its commit is refused, stays
    unrecorded (no restore point), and the next commit, whose step went through, is
    recorded. A refused commit leaves ``recorded_step`` as it was, so a forged one of
    any step blocks no later real one."""
    if not authority.commits:
        return (
            f"{authority.node} reported a checkpoint commit, but rank 0 of generation "
            f"{authority.generation} (the committing rank) is not on it"
        )
    if step < 1:
        return f"{authority.node} reported a checkpoint of step {step}: steps count from 1"
    expected = committed_path(authority.checkpoint_dir, step)
    if not expected or posixpath.normpath(path) != expected:
        where = (
            f"its committed path {expected}"
            if expected
            else "nowhere (the job has no checkpoint_dir)"
        )
        return (
            f"{authority.node} reported the checkpoint of step {step} at {path!r}, not at {where}"
        )
    if step <= bounds.recorded_step:
        return ""
    if bounds.target_steps and step > bounds.target_steps:
        return (
            f"{authority.node} reported a checkpoint of step {step}, past the job's "
            f"{bounds.target_steps} steps"
        )
    if step > bounds.reported_step:
        return (
            f"{authority.node} reported a checkpoint of step {step}, but rank 0 of "
            f"generation {authority.generation} has reported step {bounds.reported_step}"
        )
    return ""


def memory_snapshot_refusal(authority: NodeAuthority, step: int, target_steps: int) -> str:
    """A memory snapshot's commit is recorded only from rank 0's node (the rank that
    reports it once every node committed), at a step from 1 and within the job's
    target. Unlike a durable commit it may come before the step reports of its step
    (a snapshot is reported as soon as it is committed, from its own thread): its
    record changes no restore (each rank restores only what its node holds, whole),
    it tells the operator what memory holds."""
    if not authority.commits:
        return (
            f"{authority.node} reported a memory snapshot, but rank 0 of generation "
            f"{authority.generation} (the reporting rank) is not on it"
        )
    if step < 1:
        return f"{authority.node} reported a memory snapshot of step {step}: steps count from 1"
    if target_steps and step > target_steps:
        return (
            f"{authority.node} reported a memory snapshot of step {step}, past the job's "
            f"{target_steps} steps"
        )
    return ""


def committed_path(checkpoint_dir: str, step: int) -> str:
    """Where step ``step``'s committed checkpoint lives in ``checkpoint_dir``, as
    normalized text ("" without an absolute directory): the name
    ``trainer.checkpoint_dir.committed_path`` gives it."""
    if not checkpoint_dir.startswith("/"):
        return ""
    return posixpath.join(posixpath.normpath(checkpoint_dir), f"step_{step:08d}")


def problem_refusal(
    authority: NodeAuthority, kind: CheckpointProblemKind, generation: int, suspect_node: str
) -> str:
    """A checkpoint problem of generation ``generation`` (at most the current one)
    that marks a checkpoint quarantined, a node suspect or the job's directory
    another lineage's comes only from the current generation's rank 0;
    ``suspect_node``, if named, must be a node's name."""
    if kind in RANK_ZERO_PROBLEMS and not (
        generation == authority.generation and authority.commits
    ):
        return (
            f"{authority.node} reported a checkpoint {kind.value} problem of generation "
            f"{generation}, but does not host rank 0 of generation {authority.generation}"
        )
    if suspect_node and not NODE_NAME.match(suspect_node):
        return f"{authority.node} named {suspect_node[:80]!r} as a suspect, which is no node name"
    return ""


def rendezvous_taken(starting: bool, first_node: str, node: str, port: int) -> bool:
    """Whether a rendezvous endpoint ``node`` reports is the generation's: the job is
    being started, the node hosts the placement's first part (rank 0), and the port is
    one (a late report of an earlier attempt, or of another node, is passed over)."""
    return starting and bool(first_node) and node == first_node and 0 < port < 65536


@dataclass(frozen=True)
class Reporting:
    """What the controller lets report steps, as published for checks made before any
    lock (``batch_refusal``): the generation of each job whose placement is known, and
    its nodes."""

    generation: int
    nodes: frozenset[str]


def batch_refusal(
    node: str,
    job: str,
    generation: int,
    entries: int,
    reports: int,
    reporting: Reporting | None,
    max_reports: int,
) -> str:
    """Why a batch of step reports from ``node`` (``entries`` NodeSteps carrying
    ``reports`` rank reports, for ``job``'s ``generation``) is refused before it is
    looked at under the state lock, or "". ``reporting``: that job's, None if no such
    job is known. A batch of a generation other than the one published passes: the
    check under the lock, which knows the current one, judges it."""
    if entries > max_reports or reports > max_reports:
        return (
            f"{node} sent a batch of {entries} steps ({reports} rank reports); "
            f"a batch carries at most {max_reports}"
        )
    if reporting is None:
        return f"{node} reported steps of job {job!r}, which does not exist"
    if generation == reporting.generation and node not in reporting.nodes:
        return f"{node} reported steps of generation {generation} of {job}, which it is not part of"
    return ""
