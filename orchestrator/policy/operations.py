"""Operations on a running job, each a *checkpoint-then-stop*: replace a node (an
operator's ``keel replace``, or a straggler under the ``replace`` policy), exclude one
(``exclude`` policy), drain one (``keel drain``), or stop the job (``keel stop``).

Every rank is asked for a checkpoint now; once one after that step is committed (or
after ``CHECKPOINT_WAIT_S``, from the last committed one) the generation is stopped,
and the next one is placed without the node (or, for a stop, the job ends). Pure: the
controller passes what it observed and applies what these functions return.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from common.records import CordonRecord, OperationRecord

# An operation waits this long for its checkpoint before going ahead from the last
# committed one.
CHECKPOINT_WAIT_S = 60.0
POLICIES = ("replace", "exclude", "drain", "stop")


@dataclass(frozen=True)
class Operation:
    """A checkpoint-then-stop of a job's generation ``generation``. ``after_step`` and
    ``requested_at`` (monotonic seconds) are set once the leader has begun it (asked
    for the checkpoint); an operation restored from etcd after a failover, or just
    recorded by an operator's call, has not begun."""

    node: str  # the node leaving the job; "" for a job stop
    reason: str
    policy: str  # one of POLICIES
    generation: int = 0
    with_node: str = ""  # replace: the node to take its place ("" = any free one)
    checkpoint: bool = True  # False: stop at once from the last committed checkpoint
    origin: str = "operator"  # who asked: "operator" or "straggler" (a slow node's remedy)
    after_step: int | None = None
    requested_at: float | None = None

    @property
    def begun(self) -> bool:
        return self.requested_at is not None

    def begin(self, step: int, now: float) -> Operation:
        return replace(self, after_step=step, requested_at=now)

    def record(self) -> OperationRecord:
        """What etcd keeps of it: the intent, not this leader's progress on it."""
        return OperationRecord(
            node=self.node,
            reason=self.reason,
            policy=self.policy,
            generation=self.generation,
            with_node=self.with_node,
            checkpoint=self.checkpoint,
            origin=self.origin,
        )

    @classmethod
    def from_record(cls, record: OperationRecord) -> Operation:
        return cls(
            node=record.node,
            reason=record.reason,
            policy=record.policy,
            generation=record.generation,
            with_node=record.with_node,
            checkpoint=record.checkpoint,
            origin=record.origin,
        )


# Who cordons a node whose agent drains it on its way out (SIGTERM).
BY_AGENT = "agent"


def agent_cordon(leaving: str, pid: int, cordon: CordonRecord | None) -> tuple[str, str] | None:
    """What a node's agent (process ``pid``) asks of the node's ``cordon`` (as stored,
    or None): ``("drain", reason)`` when it is leaving (``leaving``: why) and the node is
    not cordoned yet, as `keel drain` would; ``("lift", reason)`` when another agent
    process runs on a node its predecessor drained on its way out (the node is back);
    else None. An operator's cordon is never lifted here."""
    if leaving:
        return ("drain", f"drained by its agent: {leaving}") if cordon is None else None
    if cordon is not None and cordon.by == BY_AGENT and cordon.pid != pid:
        return "lift", f"a new agent (pid {pid}) runs on the node its predecessor drained"
    return None


class Change(str, enum.Enum):
    NONE = "NONE"
    BEGIN = "BEGIN"  # ask for the checkpoint now; ``operation`` is what to begin
    CALL_OFF = "CALL_OFF"  # the operation no longer applies; ``reason`` says why


@dataclass(frozen=True)
class OperationDecision:
    change: Change
    reason: str = ""
    operation: Operation | None = None


def ensure(
    pending: Operation | None,
    generation: int,
    stop_requested: str,
    stop_now: bool,
    draining: tuple[str, ...],
) -> OperationDecision:
    """Level-based, for a running job: what to do so that the operation its state calls
    for is under way. ``pending``: the operation known now; ``stop_requested``: the
    operator's stop reason, if any (``stop_now``: without a final checkpoint);
    ``draining``: the job's nodes that are being drained, sorted."""
    if stop_requested:
        if pending is None or pending.policy != "stop":
            return OperationDecision(
                Change.BEGIN,
                stop_requested,
                Operation(
                    node="",
                    reason=stop_requested,
                    policy="stop",
                    generation=generation,
                    checkpoint=not stop_now,
                ),
            )
        return OperationDecision(Change.NONE)
    if pending is not None and pending.policy == "drain" and pending.node not in draining:
        return OperationDecision(Change.CALL_OFF, f"drain of {pending.node} called off")
    if pending is None and draining:
        reason = f"drain {', '.join(draining)}"
        return OperationDecision(
            Change.BEGIN,
            reason,
            Operation(node=draining[0], reason=reason, policy="drain", generation=generation),
        )
    if pending is not None and not pending.begun:
        return OperationDecision(Change.BEGIN, pending.reason, pending)
    return OperationDecision(Change.NONE)


def ready(
    now: float,
    pending: Operation | None,
    last_checkpoint_step: int | None,
    last_checkpoint_generation: int,
    generation: int,
) -> str:
    """The reason to stop the generation for ``pending`` now, or "" while it waits for
    its checkpoint: one after the step it was begun at, committed by this generation
    (or waiting took longer than ``CHECKPOINT_WAIT_S``, or it asked for none)."""
    if pending is None or not pending.begun:
        return ""
    if not pending.checkpoint:
        return f"{pending.reason}, without a final checkpoint"
    if last_checkpoint_step is not None and checkpoint_after(
        last_checkpoint_step, last_checkpoint_generation, pending.after_step, generation
    ):
        return f"{pending.reason} after checkpoint at step {last_checkpoint_step}"
    if now - pending.requested_at > CHECKPOINT_WAIT_S:
        return (
            f"{pending.reason}; no checkpoint within {CHECKPOINT_WAIT_S:.0f}s, "
            f"restoring the last committed one"
        )
    return ""


def checkpoint_after(step: int, generation: int, after_step: int, of_generation: int) -> bool:
    """Whether a committed checkpoint (of ``step``, by ``generation``) is one asked for
    after ``after_step`` in ``of_generation``: a later step, by that generation."""
    return step > after_step and generation == of_generation


@dataclass(frozen=True)
class Target:
    """Where the generation after a planned stop may go: ``free_slots`` to place on,
    whether it must be re-planned smaller (``shrink``, to at most ``ceiling`` ranks
    when that is not 0), and an ``alert`` (about ``alert_node``) when the operation
    cannot be carried out as asked."""

    free_slots: dict[str, int]
    shrink: bool
    ceiling: int = 0
    alert: str = ""
    alert_node: str = ""


def target(
    pending: Operation | None,
    free_slots: dict[str, int],
    shrink: bool,
    job_nodes: frozenset[str],
    world_size: int,
    spec_world_size: int,
    ranks_on_node: int,
) -> Target:
    """The placement the next generation is planned on, for a job whose generation
    ``pending`` stopped on purpose (None: it did not). ``job_nodes``, ``world_size``:
    the stopped generation's; ``ranks_on_node``: how many of its ranks ran on
    ``pending.node``."""
    if pending is None or not pending.node:
        return Target(free_slots, shrink)
    alert = ""
    if pending.with_node:
        out, into = pending.node, pending.with_node
        wanted = (job_nodes - {out}) | {into}
        if wanted <= free_slots.keys() and sum(free_slots[n] for n in wanted) >= spec_world_size:
            free_slots = {n: free_slots[n] for n in wanted}
        else:
            alert = f"{into} can no longer take {out}'s place; placing on any free node"
    if pending.policy == "exclude":
        # The exclude policy drops the node even when a spare could take its place.
        return Target(free_slots, True, world_size - ranks_on_node, alert, pending.node)
    return Target(free_slots, shrink, 0, alert, pending.node)


def replace_problem(
    node: str,
    with_node: str,
    job: str,
    job_nodes: frozenset[str],
    ranks_on_node: int,
    spare_slots: dict[str, int],
    cordoned: frozenset[str],
) -> str:
    """Why ``node`` of job ``job`` cannot be replaced now (by ``with_node``, or by any
    node with ``spare_slots``: free slots outside the job), or "" if it can."""
    if not with_node:
        if sum(spare_slots.values()) < ranks_on_node:
            return (
                f"no free node can take {node}'s {ranks_on_node} rank(s); add a node, "
                f"or `keel drain {node}` to re-plan smaller"
            )
        return ""
    problem = ""
    if with_node in job_nodes:
        problem = f"it already runs job {job}"
    elif with_node in cordoned:
        problem = "it is cordoned (`keel uncordon` it first)"
    elif with_node not in spare_slots:
        problem = "it is not free (disconnected or running another job)"
    elif spare_slots[with_node] < ranks_on_node:
        problem = f"it has {spare_slots[with_node]} slot(s) and {node} runs {ranks_on_node} rank(s)"
    return f"{with_node} cannot take {node}'s place: {problem}" if problem else ""


def without_node(ranks_on_node: int, spare_slots: dict[str, int], min_nodes: int) -> str:
    """How a job will do without a node running ``ranks_on_node`` of its ranks, judged
    from the free slots outside it now."""
    free = sum(spare_slots.values())
    if free >= ranks_on_node:
        return f"on free nodes ({free} slot(s) free, {ranks_on_node} needed)"
    if min_nodes:
        return (
            f"on a re-planned smaller layout (no free node for its {ranks_on_node} "
            f"rank(s); min_nodes {min_nodes})"
        )
    return (
        f"once {ranks_on_node} slot(s) are free: the job may not shrink (min_nodes 0) and "
        f"no free node can take its {ranks_on_node} rank(s)"
    )
