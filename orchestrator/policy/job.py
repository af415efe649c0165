"""What the controller should do next with a job's lifecycle: a pure decision.

``decide(now, observed, spec)`` reads a snapshot built by the controller and returns an
action and a reason a person can act on. No I/O, no clock reads: the caller passes
``now`` (seconds, monotonic or wall, as long as ``Observed`` uses the same clock).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from orchestrator.policy.lifecycle import JobState

# What can end a generation (``Decision.cause``), as the restarts metric counts them.
RESTART_CAUSES = ("crash", "hang", "straggler", "node_lost", "operator", "agent_restart")
# A rank that left its generation alive says the generation failed under it (a peer
# gone): when that is all the controller has heard, it waits this long for the peer's
# own exit (a SIGKILLed rank is reaped a tick after its sockets close, or later on a
# loaded node, while its peers may park at once) before it names the parked rank.
PARKED_CAUSE_GRACE_S = 1.0


class Action(str, enum.Enum):
    WAIT = "WAIT"  # nothing to do yet; the reason says what is awaited
    PREPARE = "PREPARE"  # choose nodes for the next generation, ask for a rendezvous
    START = "START"  # write the plan, start the ranks
    STOP = "STOP"  # tear the generation down (the reason names the cause)
    RESTART = "RESTART"  # the stopped generation is gone: plan the next one
    SUCCEED = "SUCCEED"
    FAIL = "FAIL"
    CANCEL = "CANCEL"  # the operator stopped the job and nothing of it runs


@dataclass(frozen=True)
class RankExit:
    node: str
    rank: int
    pid: int
    exit_code: int
    signal: int
    exited_at: float
    stopped_by_agent: bool
    traceback: str = ""
    stderr_tail: str = ""
    last_step: int = 0
    reported_at: float = 0.0  # unix seconds, when the controller heard of it
    reaped_at: float = 0.0  # unix seconds, when its agent reaped the process
    # It left its generation alive because the generation failed under it (a peer's
    # failure by its own account, ``trainer.runtime.in_place``): kept for the next one.
    parked: bool = False
    heard_at: float = 0.0  # when the controller heard of it, on ``decide``'s clock

    @property
    def failed(self) -> bool:
        return not self.stopped_by_agent and (self.exit_code != 0 or self.signal != 0)

    def describe(self) -> str:
        how = (
            f"killed by signal {self.signal}"
            if self.signal
            else f"exited with code {self.exit_code}"
        )
        last_line = self.traceback.strip().splitlines()[-1] if self.traceback.strip() else ""
        text = f"rank {self.rank} (pid {self.pid}) on node {self.node} {how}"
        if self.last_step:
            text += f" after step {self.last_step}"
        return text + (f": {last_line}" if last_line else "")


@dataclass(frozen=True)
class Observed:
    state: JobState
    state_since: float  # when the job entered ``state``
    restarts: int
    generation: int = 0  # generations started so far
    generation_world_size: int = 0  # ranks of the current generation (may be shrunk)
    # Usable nodes not busy elsewhere; the controller fills it (and suspect_slots) only
    # for a PENDING job, the one state that places.
    free_slots: dict[str, int] = field(default_factory=dict)
    # Free slots on nodes the last generation had trouble with (hung, slow, moved off
    # on purpose): used only when the job cannot start without them.
    suspect_slots: dict[str, int] = field(default_factory=dict)
    generation_nodes: frozenset[str] = frozenset()  # nodes of the current generation
    rendezvous_ready: bool = False
    exits: tuple[RankExit, ...] = ()  # exits seen in the current generation
    lost_nodes: frozenset[str] = frozenset()  # generation nodes gone from etcd/stream
    unreachable_nodes: frozenset[str] = frozenset()  # stream down, not (yet) declared lost
    vanished_nodes: frozenset[str] = frozenset()  # agent came back without its ranks
    hang: str = ""  # an agent declared a rank hung: its reason
    replace: str = ""  # a checkpoint-then-stop (node replacement, drain,
    # operator stop) is ready to go: its reason
    replace_origin: str = "operator"  # ... and who began it: "operator" or "straggler"
    stop_requested: str = ""  # the operator stopped the job: their reason
    planned_stop: bool = False  # the generation was stopped on purpose (a node
    # replaced or drained), not by a failure
    backoff_s: float = 0.0  # wait this long in PENDING after a failure
    stopped_nodes: frozenset[str] = frozenset()  # nodes that confirmed the stop
    # What no restart can mend (the checkpoint directory holds another lineage's
    # checkpoints): its reason; the job ends FAILED with it.
    fatal: str = ""


@dataclass(frozen=True)
class Spec:
    world_size: int
    max_restarts: int
    rendezvous_timeout_s: float
    min_nodes: int = 0  # a job that ran may shrink to this many nodes; 0 = never


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    root_cause: RankExit | None = field(default=None)
    shrink: bool = False  # PREPARE on fewer slots than the spec asks for
    collect_stacks: bool = False  # STOP of a hang: every agent dumps stacks first
    replacement: bool = False  # STOP to carry out a node replacement
    use_suspects: tuple[str, ...] = ()  # PREPARE on these suspect nodes too (no spare)
    alert: str = ""  # a person should know this: recorded as an alert event
    # STOP: what ended the generation, one of RESTART_CAUSES (the operation's origin for
    # a replacement: "straggler" or "operator"); "" for an operator's stop of the job.
    cause: str = ""
    awaits_capacity: bool = False  # WAIT in PENDING: not enough free slots


def root_cause(exits: tuple[RankExit, ...]) -> RankExit | None:
    """The earliest failed exit: later ones are usually peers losing their connection.
    A rank's own failure comes before any parked rank's (one that says the generation
    failed under it), whenever each was dated: a parked rank is dated when it parked,
    and the rank whose exit it saw may be reaped later than that."""
    failed = [e for e in exits if e.failed]
    return min(failed, key=lambda e: (e.parked, e.exited_at, e.rank)) if failed else None


def decide(now: float, observed: Observed, spec: Spec) -> Decision:
    state = observed.state
    if observed.stop_requested:
        if state is JobState.PENDING:
            return Decision(Action.CANCEL, observed.stop_requested)
        if state is JobState.STARTING:
            return Decision(Action.STOP, observed.stop_requested)
    if observed.fatal and state in (JobState.STARTING, JobState.RUNNING):
        return Decision(Action.STOP, observed.fatal, root_cause(observed.exits), cause="crash")
    if observed.fatal and state is JobState.PENDING:
        return Decision(Action.FAIL, observed.fatal)
    if state is JobState.PENDING:
        waited = now - observed.state_since
        if waited < observed.backoff_s:
            return Decision(
                Action.WAIT,
                f"backing off {observed.backoff_s:.1f}s after restart {observed.restarts}",
            )
        decision = _place(observed.free_slots, observed.generation, spec)
        if decision.action is Action.WAIT and observed.suspect_slots:
            # No spare to replace a suspect node: run on it rather than not at all.
            widened = _place(
                {**observed.free_slots, **observed.suspect_slots}, observed.generation, spec
            )
            if widened.action is Action.PREPARE:
                suspects = tuple(sorted(observed.suspect_slots))
                return replace(
                    widened,
                    use_suspects=suspects,
                    alert=f"no spare to replace {', '.join(suspects)}; restarting on it",
                )
        return decision

    if state is JobState.STARTING:
        if observed.lost_nodes:
            return Decision(
                Action.STOP,
                f"node {', '.join(sorted(observed.lost_nodes))} lost while starting",
                cause="node_lost",
            )
        if observed.rendezvous_ready:
            return Decision(Action.START, "rendezvous endpoint published")
        waited = now - observed.state_since
        if waited > spec.rendezvous_timeout_s:
            return Decision(
                Action.STOP,
                f"no rendezvous endpoint after {waited:.0f}s "
                f"(limit {spec.rendezvous_timeout_s:.0f}s)",
                cause="crash",
            )
        return Decision(Action.WAIT, "waiting for the rendezvous endpoint")

    if state is JobState.RUNNING:
        if observed.hang:
            return Decision(Action.STOP, observed.hang, collect_stacks=True, cause="hang")
        cause = root_cause(observed.exits)
        gone = observed.lost_nodes | observed.unreachable_nodes | observed.vanished_nodes
        if cause is not None and cause.parked and not gone:
            waited = now - cause.heard_at
            if waited < PARKED_CAUSE_GRACE_S:
                return Decision(
                    Action.WAIT,
                    f"rank {cause.rank} on node {cause.node} left the generation, which "
                    f"failed under it; waiting {PARKED_CAUSE_GRACE_S - waited:.1f}s more "
                    "for the rank that failed",
                )
        if cause is not None:
            if gone and cause.node not in gone:
                # Peers of a vanished node fail with connection errors at once, seconds
                # before its lease expires: the vanished node is the likelier cause.
                return Decision(
                    Action.STOP,
                    f"node {', '.join(sorted(gone))} unreachable; then {cause.describe()}",
                    cause,
                    cause="agent_restart" if gone <= observed.vanished_nodes else "node_lost",
                )
            return Decision(Action.STOP, cause.describe(), cause, cause="crash")
        if observed.lost_nodes:
            return Decision(
                Action.STOP,
                f"node {', '.join(sorted(observed.lost_nodes))} lost",
                cause="node_lost",
            )
        if observed.vanished_nodes:
            return Decision(
                Action.STOP,
                f"the agent of {', '.join(sorted(observed.vanished_nodes))} "
                f"restarted; its ranks died with it",
                cause="agent_restart",
            )
        if observed.replace:
            return Decision(
                Action.STOP, observed.replace, replacement=True, cause=observed.replace_origin
            )
        ranks = observed.generation_world_size
        done = sum(1 for e in observed.exits if e.exit_code == 0 and e.signal == 0)
        if done == ranks:
            return Decision(Action.SUCCEED, f"all {done} ranks exited 0")
        return Decision(Action.WAIT, f"{ranks - done}/{ranks} ranks running")

    if state is JobState.STOPPING:
        waiting = observed.generation_nodes - observed.lost_nodes - observed.stopped_nodes
        if waiting:
            return Decision(
                Action.WAIT,
                f"waiting for {len(waiting)} node(s) to stop their "
                f"ranks: {', '.join(sorted(waiting))}",
            )
        if observed.stop_requested:
            return Decision(Action.CANCEL, observed.stop_requested)
        if observed.fatal:
            return Decision(Action.FAIL, observed.fatal)
        if observed.planned_stop:
            # A move planned around a checkpoint is no failure: it spends no restart.
            return Decision(
                Action.RESTART,
                "generation stopped as planned; starting the next one",
                replacement=True,
            )
        if observed.restarts >= spec.max_restarts:
            return Decision(
                Action.FAIL, f"generation failed and all {spec.max_restarts} restarts are used up"
            )
        return Decision(
            Action.RESTART,
            f"generation stopped; restart {observed.restarts + 1}/{spec.max_restarts}",
        )

    return Decision(Action.WAIT, f"job is {state.value}")


def _place(free_slots: dict[str, int], generation: int, spec: Spec) -> Decision:
    """PREPARE on ``free_slots`` if the job fits (or, having run, may shrink into them);
    else WAIT, saying for what."""
    free = sum(free_slots.values())
    nodes = sum(1 for s in free_slots.values() if s > 0)
    if free >= spec.world_size:
        return Decision(
            Action.PREPARE, f"{free} slots free on {nodes} nodes, need {spec.world_size}"
        )
    # Only a job that has run shrinks: at first start, agents join one by one and a
    # job must not start on whichever node happened to come first.
    if generation and spec.min_nodes and nodes >= spec.min_nodes:
        return Decision(
            Action.PREPARE,
            f"capacity lost and no spare: {free}/{spec.world_size} slots free "
            f"on {nodes} nodes; re-planning smaller (min_nodes "
            f"{spec.min_nodes})",
            shrink=True,
        )
    floor = f", or {spec.min_nodes} nodes to shrink to" if spec.min_nodes and generation else ""
    return Decision(
        Action.WAIT,
        f"{free}/{spec.world_size} slots free on {nodes} nodes, need {spec.world_size}{floor}",
        awaits_capacity=True,
    )
