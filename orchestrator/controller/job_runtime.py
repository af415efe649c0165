"""What the leading controller knows of one job: its spec, lifecycle state and
generation, and what the agents reported about it. Rebuilt from etcd by a controller
that takes over; ``record()`` is the part stored there."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from common.records import (
    CheckpointRecord,
    CheckpointRequestRecord,
    JobStateRecord,
    MemorySnapshotRecord,
)
from orchestrator.controller.goodput import Goodput
from orchestrator.controller.job_health import JobHealth
from orchestrator.controller.recovery import Recovery
from orchestrator.policy.job import RankExit
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.operations import Operation
from orchestrator.policy.placement import NodeRanks
from orchestrator.spec.health import resolve as resolve_health
from protos import keel_pb2

# Root causes of failed generations a job keeps, newest last (each up to ~12 KB of
# traceback and stderr, in the job's state record: etcd takes 1.5 MiB a request).
MAX_FAILURES = 20
# Generations whose placement a leader remembers (in memory only), for rank logs.
PLACEMENTS_KEPT = 64


RECENT_STEPS = 5  # a rank's latest own step times its series is the median of
TOKENS_WINDOW_S = 10.0  # the tokens/s figure is over the reports of this long


class TokenRate:
    """Tokens per second over the report batches of the last ``window_s`` seconds,
    with a running total: adding a batch and reading the rate are O(1), however
    many ranks report."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._batches: collections.deque = collections.deque()  # (at, tokens)
        self._total = 0

    def add(self, at: float, tokens: int) -> None:
        batches = self._batches
        batches.append((at, tokens))
        self._total += tokens
        while batches[-1][0] - batches[0][0] > self.window_s:
            self._total -= batches.popleft()[1]

    def per_s(self) -> float:
        """The tokens after the oldest batch over the time since it; 0 without two."""
        batches = self._batches
        span = batches[-1][0] - batches[0][0] if len(batches) > 1 else 0.0
        return (self._total - batches[0][1]) / span if span > 0 else 0.0


@dataclass(eq=False)
class Progress:
    """What the ranks' step reports say of the job: rank 0's latest step in the current
    generation (the step it restored until it reports one) and loss, the job's first
    loss, its tokens, and the step times the straggler and status views read."""

    step: int = 0
    loss: float = 0.0
    initial_loss: float = 0.0
    has_loss: bool = False
    initial_loss_stored: bool = False  # the first loss is in etcd (with the job state)
    tokens: int = 0
    token_window: TokenRate = field(default_factory=lambda: TokenRate(TOKENS_WINDOW_S))
    step_times: collections.deque = field(  # the latest reported step times, seconds
        default_factory=lambda: collections.deque(maxlen=64)
    )
    # Each node's latest steps (ranks, their own step times in seconds), for the
    # slowest ranks' series: kept a node's step at a time, read a rank at a time only
    # when the series is scraped (``recent_rank_times``).
    node_step_times: dict[str, collections.deque] = field(default_factory=dict)

    def recent_rank_times(self) -> dict[int, list[float]]:
        """Each rank's own step times (measured: > 0) in its node's latest
        ``RECENT_STEPS`` steps."""
        times: dict[int, list[float]] = {}
        for recent in self.node_step_times.values():
            for ranks, seconds in recent:
                for rank, value in zip(ranks, seconds):
                    if value > 0:
                        times.setdefault(rank, []).append(value)
        return times

    def tokens_per_s(self) -> float:
        """Tokens per second over the latest reports of the current generation."""
        return self.token_window.per_s()


@dataclass(eq=False)
class Intents:
    """What the operator or a policy asked of the job, not yet done: a stop (with the
    operator's reason; ``stop_now``: without a final checkpoint; stored with the job's
    state), the checkpoint-then-stop under way (stored when it cannot be derived again
    from the cordons and the stop request: a replacement, an exclusion), and a
    checkpoint request (stored) with whether this leader has passed it on."""

    stop_requested: str = ""
    stop_now: bool = False
    operation: Operation | None = None
    checkpoint_request: CheckpointRequestRecord | None = None
    checkpoint_request_sent: bool = False


@dataclass(eq=False)
class JobRuntime:
    """What the leader holds of one job: its spec; the persisted lifecycle (state,
    generation, restarts, failures, the accounting; ``record()`` is what etcd stores);
    the current generation's plan and what its agents reported of it; and, each
    apart, its ``progress``, the ``intents`` under way, its ``health`` record and its
    ``goodput``. ``*_mono`` times are monotonic seconds, ``*_unix`` wall-clock."""

    spec: keel_pb2.JobSpec
    state: JobState
    state_rev: int
    state_since_mono: float
    job_id: str = ""  # unique, made at submit: the job's lineage (JobSpecRecord)
    generation: int = 0
    restarts: int = 0
    reason: str = ""
    failures: list[keel_pb2.Failure] = field(default_factory=list)
    placement: list[NodeRanks] = field(default_factory=list)
    world_size: int = 0  # of the current generation (the spec's until one starts)
    mesh: str = ""  # layout of the current generation
    rendezvous: tuple[str, int] | None = None
    deadlines: keel_pb2.Deadlines | None = None  # of the current generation, once placed
    restore_from: str = ""  # the checkpoint path the generation restores ("": none)
    restore_step: int | None = None  # its step, if its record is known
    restore_fallbacks: list[str] = field(default_factory=list)  # paths, newest first
    fatal: str = ""  # what no restart can mend (policy.job.Observed.fatal)
    exits: dict[int, RankExit] = field(default_factory=dict)
    stopped_nodes: set[str] = field(default_factory=set)
    lost_nodes: set[str] = field(default_factory=set)
    vanished: dict[str, list[int]] = field(
        default_factory=dict
    )  # node -> ranks gone with its agent
    progress: Progress = field(default_factory=lambda: Progress())
    intents: Intents = field(default_factory=lambda: Intents())
    last_checkpoint: CheckpointRecord | None = None
    last_wait_reason: str = ""  # logged last (executor.apply), and when:
    last_wait_logged_mono: float = 0.0
    health: JobHealth | None = None
    unrecorded: list[CheckpointRecord] = field(default_factory=list)  # not yet in etcd
    # The newest complete memory snapshot recorded in etcd, and a newer one reported
    # but not yet recorded (the reconcile loop records the newest only).
    last_memory_snapshot: MemorySnapshotRecord | None = None
    unrecorded_memory_snapshot: MemorySnapshotRecord | None = None
    # This generation's: the partner each node's snapshots are replicated to, and the
    # copy (node, step, holder) its one node brings into memory before its ranks start
    # (``policy.memory_snapshots``). Not stored: a new leader learns the partners of
    # the generation it adopts from the agents' Hellos (``Hello.replica_node``), and
    # chooses anew for the starts it sends, whose generation restores from storage.
    replica_partners: dict[str, str] = field(default_factory=dict)
    # monotonic: a lost partner found no other to replace it; looked for again from
    # then (``Executor.repartner``).
    repartner_after: float = 0.0
    memory_copy: tuple[str, int, str] | None = None
    # Checkpoints ranks would not or could not use (refused stale commits, failed
    # verifications, ...), for the reconcile loop to record: (the reporting node, its
    # CheckpointProblem) each.
    checkpoint_problems: list[tuple[str, keel_pb2.CheckpointProblem]] = field(default_factory=list)
    planned_stop: bool = False  # the current generation was stopped on purpose (persisted)
    # The pid of the agent incarnation each node's ranks are planned for (persisted in
    # the plan): only that one may still be given their start.
    placed_agents: dict[str, int] = field(default_factory=dict)
    # A reconcile failed: what is held here may differ from etcd, so the job is rebuilt
    # from etcd before it is reconciled again.
    rebuild: bool = False
    # Its checkpoint records in etcd were pruned since it was read from there.
    records_pruned: bool = False
    # When it ended (wall clock, persisted): finished jobs are deleted a retention after.
    ended_at_unix: float | None = None
    # Back-off after a reconcile error that may clear (etcd out of reach).
    retry_at_mono: float = 0.0
    retry_backoff_s: float = 0.0
    # Accounting, persisted with the state at each transition (docs/metrics.md): where
    # the wall time went, generations ended by cause, checkpoints ranks would not use
    # by kind, and seconds spent in each state before the current one (entered at
    # ``state_entered_at_unix``, wall clock).
    goodput: Goodput | None = None
    restarts_by_cause: dict[str, int] = field(default_factory=dict)
    checkpoint_problem_counts: dict[str, int] = field(default_factory=dict)
    state_seconds: dict[str, float] = field(default_factory=dict)
    state_entered_at_unix: float = field(default_factory=time.time)
    # The latest generation change under way, for the recovery histograms; None when
    # no recovery is under way.
    recovery: Recovery | None = None
    # Which node ran each rank of the generations this leader placed (the newest
    # PLACEMENTS_KEPT), so their output can be read after they ended.
    placements: dict[int, dict[int, str]] = field(default_factory=dict)
    # The index of ``placement`` (``_by_node``) and the placement it was made of.
    _index: dict = field(default_factory=dict, repr=False, compare=False)
    _nodes: frozenset = field(default=frozenset(), repr=False, compare=False)
    _parts: dict = field(default_factory=dict, repr=False, compare=False)
    _positions: dict = field(default_factory=dict, repr=False, compare=False)
    _indexed: object = field(default=None, repr=False, compare=False)
    # When the current generation was placed, and how many generations in a row failed
    # without a healthy stretch (policy.guardrails): the restart back-off.
    placed_at_mono: float = 0.0
    repeated_failures: int = 0

    def __post_init__(self):
        if self.goodput is None:
            slowdown = self.health.spec.straggler_slowdown if self.health else 1.25
            self.goodput = Goodput(time.time(), slowdown)

    @classmethod
    def new(
        cls, spec: keel_pb2.JobSpec, state: JobState, state_rev: int, since_mono: float, **fields
    ) -> JobRuntime:
        """Job ``spec`` in ``state`` (as stored at ``state_rev``, entered at
        ``since_mono``), its health record made from the spec's health settings."""
        health = JobHealth(spec.name, resolve_health(spec.health))
        return cls(
            spec=spec,
            state=state,
            state_rev=state_rev,
            state_since_mono=since_mono,
            health=health,
            **fields,
        )

    @property
    def name(self) -> str:
        return self.spec.name

    def _by_node(self) -> dict[str, frozenset[int]]:
        """The current placement's ranks by node, indexed once per placement, since
        every agent message asks it. A new plan replaces ``placement`` whole, never
        changes it in place, so the index stands while ``placement`` is the list it was
        made of; that list is held here (``_indexed``), so a later list can never be
        taken for it. A node holds one part of a placement."""
        if self._indexed is not self.placement:
            by_node = {part.node: frozenset(part.ranks) for part in self.placement}
            self._parts = {part.node: part for part in self.placement}
            self._positions = {part.node: i for i, part in enumerate(self.placement)}
            self._index, self._nodes, self._indexed = by_node, frozenset(by_node), self.placement
        return self._index

    def part_on(self, node: str) -> NodeRanks | None:
        """The current placement's part on ``node``."""
        self._by_node()
        return self._parts.get(node)

    def group_rank(self, part: NodeRanks) -> int:
        """``part``'s position in the current placement (its node's group rank, as
        torchrun's): ``placement.index(part)``, without a search of the placement for
        each node."""
        self._by_node()
        return self._positions[part.node]

    @property
    def nodes(self) -> frozenset[str]:
        self._by_node()
        return self._nodes

    def ranks_on_node(self, node: str) -> frozenset[int]:
        """The current placement's ranks on ``node``."""
        return self._by_node().get(node, frozenset())

    @property
    def rank_nodes(self) -> dict[int, str]:
        """Each rank of the current placement, and its node."""
        return {rank: p.node for p in self.placement for rank in p.ranks}

    def remember_placement(self) -> None:
        """Keep the current generation's rank-to-node map among the recent ones."""
        self.placements[self.generation] = self.rank_nodes
        while len(self.placements) > PLACEMENTS_KEPT:
            del self.placements[min(self.placements)]

    def node_of(self, generation: int, rank: int) -> str | None:
        """The node that ran (or runs) ``rank`` in ``generation``, if known here."""
        ranks = (
            self.rank_nodes
            if generation == self.generation
            else self.placements.get(generation, {})
        )
        return ranks.get(rank)

    def ranks_on(self, node: str) -> int:
        """How many ranks of the current placement run on ``node``."""
        return sum(len(p.ranks) for p in self.placement if p.node == node)

    def record(self) -> JobStateRecord:
        """The job state as stored in etcd."""
        return JobStateRecord(
            state=self.state,
            generation=self.generation,
            restarts=self.restarts,
            reason=self.reason,
            failures=list(self.failures),
            initial_loss=self.progress.initial_loss if self.progress.has_loss else None,
            stop_requested=self.intents.stop_requested,
            stop_now=self.intents.stop_now,
            planned_stop=self.planned_stop,
            ended_at_unix=self.ended_at_unix,
            goodput=self.goodput.record(),
            restarts_by_cause=dict(self.restarts_by_cause),
            checkpoint_problems=dict(self.checkpoint_problem_counts),
            state_seconds=dict(self.state_seconds),
            state_entered_at_unix=self.state_entered_at_unix,
            tokens=self.progress.tokens,
            step=self.progress.step,
        )
