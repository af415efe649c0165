"""Nodes a job's next generation stays off for what happened on them: repeat
offenders (its ranks failed there in the generations just before) and nodes a
checkpoint problem points at (the checkpoint could not be read there; a process there
held the fence lock past its deadline). Pure: the controller keeps the history and
the problems, and places the next generation around what these return (as
``remediation.suspects``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.wire_kinds import CheckpointProblemKind
from protos import keel_pb2

# A node is suspected once its ranks failed in this many generations in a row: one
# failure may be the job's (a bug, a bad batch), the same node twice in a row is
# likelier the node's (a bad GPU, a full local disk, a missing mount).
OFFENCES_IN_A_ROW = 2


@dataclass(frozen=True)
class NodeFailure:
    """A root-cause failure of ``generation`` on ``node``: a rank that crashed or hung
    there, not a rank stopped because a peer failed, nor a node lost. ``what``: the
    failure as its event tells it."""

    generation: int
    node: str
    what: str


@dataclass(frozen=True)
class Suspect:
    """A node the next generation stays off if it can, and why (the event's reason)."""

    node: str
    reason: str


def offenders(ended: int, failures: Iterable[NodeFailure]) -> list[Suspect]:
    """The nodes whose ranks failed in each of the ``OFFENCES_IN_A_ROW`` generations up
    to ``ended`` (the newest that ended), by name, each with the failures. A generation
    that failed elsewhere, or did not fail, breaks the row."""
    first = ended - OFFENCES_IN_A_ROW + 1
    if first < 1:
        return []
    seen: dict[str, dict[int, str]] = {}
    for failure in failures:
        if first <= failure.generation <= ended:
            seen.setdefault(failure.node, {}).setdefault(failure.generation, failure.what)
    found = []
    for node in sorted(seen):
        failed = seen[node]
        if len(failed) < OFFENCES_IN_A_ROW:
            continue
        generations = sorted(failed)
        listed = ", ".join(map(str, generations[:-1])) + f" and {generations[-1]}"
        found.append(
            Suspect(
                node,
                f"node {node}'s ranks failed in generations {listed}: "
                + "; ".join(failed[g] for g in generations),
            )
        )
    return found


def kept(ended: int, failures: Iterable[NodeFailure]) -> list[NodeFailure]:
    """The failures ``offenders`` may still need once generation ``ended`` has ended:
    those of the last ``OFFENCES_IN_A_ROW`` generations."""
    return [f for f in failures if f.generation > ended - OFFENCES_IN_A_ROW]


def checkpoint_suspect(
    kind: CheckpointProblemKind, reporter: str, problem: keel_pb2.CheckpointProblem
) -> Suspect | None:
    """The node a checkpoint problem that ``reporter`` reported points at, and why: for
    a checkpoint that could not be read (``UNREACHABLE``: a mount missing there, an
    I/O error) the node where it could not, whose problem it is, not the checkpoint's;
    for a fence lock not granted in time (``FENCE_TIMEOUT``) the node of the process
    holding it. Each is the problem's ``suspect_node``, or the reporter's own node when
    it names none. None for other kinds."""
    if kind not in (CheckpointProblemKind.UNREACHABLE, CheckpointProblemKind.FENCE_TIMEOUT):
        return None
    node = problem.suspect_node or reporter
    if kind is CheckpointProblemKind.UNREACHABLE:
        why = (
            f"the checkpoint of step {problem.step} could not be read on {node} "
            f"(reported by {reporter}; the checkpoint is left as it is)"
        )
    else:
        why = (
            f"a process on {node} held the checkpoint directory's fence lock past its "
            f"deadline (reported by {reporter})"
        )
    return Suspect(node, f"{why}: {problem.reason}")
