"""A job's health record: its events, the straggler detector's state, the hang being
reported, the preflight figures, and the guard rails' memory (when nodes were flagged,
when nodes were replaced, where the last generations failed, which nodes checkpoint
problems point at). The controller feeds it what agents report; the judgements
are the pure functions of ``orchestrator.policy``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog

from common.wire_kinds import WIRE_COLLECTIVES
from orchestrator.controller import metrics
from orchestrator.policy import preflight
from orchestrator.policy.diagnosis import culprit, summarize, waiting_in_collective
from orchestrator.policy.event_kind import WIRE_EVENT_KINDS, EventKind
from orchestrator.policy.offenders import NodeFailure, kept
from orchestrator.policy.retention import cut_text, events_kept
from orchestrator.policy.straggler import Flag, StepBlock, StragglerConfig, evaluate, initial_state
from protos import keel_pb2

log = structlog.get_logger()

# A job keeps its newest events within both bounds (the oldest go first, from memory
# and from etcd): every GetJob reply carries them, and a new leader reads them all.
MAX_EVENTS = 1000
MAX_EVENT_BYTES = 2 * 1024 * 1024
# Characters of stacks one hang event keeps whole; past them, each further rank keeps
# only its first line (where it is: its full dump is in its own log). The event lives
# in memory, in every GetJob reply and in etcd: it must stay well under gRPC's 4 MiB
# and etcd's 1.5 MiB.
HANG_STACKS_LIMIT = 192 * 1024


@dataclass(frozen=True)
class SlowFlag:
    """A node found slow: at ``step``, ``after_steps`` steps after it became slow."""

    node: str
    step: int
    after_steps: int
    reason: str


@dataclass(eq=False)
class JobHealth:
    job: str
    spec: keel_pb2.HealthSpec  # resolved, no zeros
    events: list[keel_pb2.Event] = field(default_factory=list)
    next_seq: int = 1
    unsaved: dict[int, keel_pb2.Event] = field(default_factory=dict)  # seq -> to (re)write
    dropped: list[int] = field(default_factory=list)  # seqs trimmed here, still in etcd
    event_bytes: dict[int, int] = field(default_factory=dict)  # seq -> serialized size
    rank_nodes: dict[int, str] = field(default_factory=dict)
    generation: int = 0
    straggler_state: object = field(default_factory=initial_state)
    samples: list[tuple[str, list]] = field(default_factory=list)  # (node, tallies) not yet scored
    latest: dict[int, int] = field(default_factory=dict)  # rank -> newest step reported
    node_latest: dict[str, int] = field(default_factory=dict)  # node -> its ranks' newest
    found_flags: list[SlowFlag] = field(default_factory=list)  # scored, for the next tick
    epoch: int = 0  # counts new generations: a score of an earlier one is dropped
    flag_times: dict[str, list[float]] = field(default_factory=dict)
    replacement_times: list[float] = field(default_factory=list)
    # Root-cause failures of the last generations, for ``policy.offenders``. In memory
    # only, like the rest of the guard rails' memory: a new leader starts without
    # it, so a node that failed just before a failover is suspected one failed
    # generation later than it would have been; failovers are rare, and etcd is
    # spared a write per failure.
    node_failures: list[NodeFailure] = field(default_factory=list)
    # Nodes checkpoint problems of the current generation point at (node -> why):
    # the next generation stays off them.
    suspected: dict[str, str] = field(default_factory=dict)
    hang_stopped: bool = False  # the generation was stopped for its hang
    hang_event: keel_pb2.Event | None = None
    hang_waiting: dict[int, bool] = field(default_factory=dict)  # rank -> waits in a collective
    hang_stack_chars: int = 0  # of the stacks the hang event keeps
    preflight: dict[str, dict[tuple[str, int], keel_pb2.CollectiveResult]] = field(
        default_factory=dict
    )
    preflight_flagged: set[str] = field(default_factory=set)
    preflight_flags: list[SlowFlag] = field(default_factory=list)  # for the next tick

    @property
    def straggler_config(self) -> StragglerConfig:
        return StragglerConfig(
            slowdown=self.spec.straggler_slowdown,
            window=self.spec.straggler_window,
            patience=self.spec.straggler_patience,
        )

    # ------------------------------------------------------------------ events
    def event(self, kind: EventKind, reason: str, **fields) -> keel_pb2.Event:
        event = keel_pb2.Event(
            kind=WIRE_EVENT_KINDS.to_wire(kind),
            reason=reason,
            generation=self.generation,
            at=time.time(),
            seq=self.next_seq,
            **fields,
        )
        self.next_seq += 1
        self.events.append(event)
        self.changed(event)
        metrics.detected(self.job, kind.value, event.detected_after_s, event.detected_after_steps)
        log.info(
            "event",
            job=self.job,
            generation=self.generation,
            kind=kind.value,
            node=event.node,
            rank=event.rank if event.HasField("rank") else None,
            step=event.step,
            reason=reason,
        )
        return event

    def changed(self, event: keel_pb2.Event) -> None:
        """``event`` is new, or was updated after it was made (stacks arriving for a
        hang): it is saved next, and the oldest events go if the bounds are passed.
        Its reason and root cause are cut to ``retention.EVENT_TEXT_BYTES`` each."""
        for name in ("reason", "root_cause"):
            text = getattr(event, name)
            cut = cut_text(text)
            if cut is not text:
                setattr(event, name, cut)
        self.unsaved[event.seq] = event
        self.event_bytes[event.seq] = event.ByteSize()
        self._trim()

    def restore(self, events: list[keel_pb2.Event]) -> None:
        """The events a previous leader saved, oldest first; those past the bounds
        are dropped, from etcd too."""
        self.events = list(events)
        self.event_bytes = {e.seq: e.ByteSize() for e in events}
        self.next_seq = events[-1].seq + 1 if events else 1
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest events past ``policy.retention.events_kept``'s bounds."""
        keep = events_kept(
            [self.event_bytes[e.seq] for e in self.events], MAX_EVENTS, MAX_EVENT_BYTES
        )
        for old in self.events[: len(self.events) - keep]:
            self.unsaved.pop(old.seq, None)
            self.event_bytes.pop(old.seq, None)
            self.dropped.append(old.seq)
        del self.events[: len(self.events) - keep]

    # ------------------------------------------------------------- generations
    def new_generation(self, generation: int, rank_nodes: dict[int, str]) -> None:
        self.generation = generation
        self.rank_nodes = rank_nodes
        self.straggler_state = initial_state()
        self.samples = []
        self.latest, self.node_latest = {}, {}
        self.found_flags = []
        self.epoch += 1
        self.suspected = {}
        self.hang_stopped = False
        self.hang_event = None
        self.hang_waiting.clear()
        self.hang_stack_chars = 0
        self.preflight.clear()
        self.preflight_flagged.clear()
        self.preflight_flags.clear()

    def note_failure(self, failure: NodeFailure) -> None:
        """Remember a root-cause failure of the generation that is ending (and forget
        those ``policy.offenders`` no longer needs)."""
        self.node_failures = kept(failure.generation, [*self.node_failures, failure])

    @property
    def hung_node(self) -> str:
        """The node of the rank the hang being reported blames; "" without a hang."""
        return self.hang_event.node if self.hang_event is not None else ""

    # ------------------------------------------------------------------- hangs
    def add_stacks(self, stacks) -> None:
        """Add ranks' stacks (rank -> first line, then the dump) to the hang event and
        name the culprit. Each stack is judged once, whole, as it arrives; the event
        keeps stacks whole up to HANG_STACKS_LIMIT characters, then first lines only."""
        event = self.hang_event
        for rank, stack in stacks.items():
            self.hang_waiting[rank] = waiting_in_collective(stack)
            before = len(event.stacks.get(rank, ""))
            room = HANG_STACKS_LIMIT - (self.hang_stack_chars - before)
            kept = stack if len(stack) <= room else stack.partition("\n")[0]
            event.stacks[rank] = kept
            self.hang_stack_chars += len(kept) - before
        blamed = culprit(self.hang_waiting)
        if blamed is not None:
            event.rank = blamed
            event.node = self.rank_nodes.get(blamed, event.node)
        where = {rank: stack.partition("\n")[0] for rank, stack in event.stacks.items()}
        event.root_cause = summarize(where, self.hang_waiting)
        self.changed(event)

    # -------------------------------------------------------------- stragglers
    def add_steps(self, node: str, tallies) -> None:
        """Steps of ``node``'s ranks (``sessions.StepTally``: a step, its ranks and
        their own step times), already checked (steps from 1, finite times)."""
        latest, newest = self.latest, self.node_latest
        self.samples.append((node, tallies))
        for tally in tallies:
            step, ranks, times = tally.step, tally.ranks, tally.step_times
            if step > newest.get(node, 0) and min(times) > 0:
                # Past the newest step of any of the node's ranks (the usual case: a
                # node's steps come in order): every rank's newest, at C speed.
                latest.update(dict.fromkeys(ranks, step))
                newest[node] = step
                continue
            for rank, seconds in zip(ranks, times):
                if seconds > 0 and step > latest.get(rank, 0):
                    latest[rank] = step
                    if step > newest.get(node, 0):
                        newest[node] = step

    # Straggler scoring runs off the state lock, on the scorer's thread (``Reconciler.
    # score_loop``): under the lock it takes the samples (``take_scoring``), scores them
    # without it (``straggler.evaluate``, a pure function of the state it took), and
    # under the lock again keeps the new state and the flags (``settle_scoring``), which
    # the next tick acts on (``slow_flags``).
    def scoring_due(self) -> bool:
        """Whether a window may be complete: every rank seen has reported a step at or
        past the end of the next window (a necessary condition, cheap to check, so that
        the samples are scored once per window, not once per tick)."""
        if not self.samples or not self.latest:
            return False
        return min(self.latest.values()) >= (
            self.straggler_state.last_step + self.spec.straggler_window
        )

    def take_scoring(self) -> tuple[int, object, Iterator[StepBlock], StragglerConfig]:
        """What the scorer scores; the samples are made as it reads them, off the lock."""
        taken, self.samples = self.samples, []
        return self.epoch, self.straggler_state, _samples(taken), self.straggler_config

    def settle_scoring(self, epoch: int, state, found: list[Flag], cleared: list[str]) -> bool:
        """Keep a score of this generation's samples; whether it flagged a node."""
        if epoch != self.epoch:
            return False  # a new generation began meanwhile
        self.straggler_state = state
        for node in cleared:
            log.info("straggler cleared", job=self.job, node=node)
        self.found_flags.extend(_flag(f) for f in found)
        return bool(found)

    def score_now(self) -> None:
        """Score what is due on this thread (what the scorer does)."""
        if self.scoring_due():
            epoch, state, samples, config = self.take_scoring()
            self.settle_scoring(epoch, *evaluate(state, samples, config))

    def slow_flags(self) -> list[SlowFlag]:
        """The nodes found slow since the last call: stragglers in the windows scored
        meanwhile, then nodes far below their peers in the preflight sweep."""
        flags = self.found_flags + self.preflight_flags
        self.found_flags, self.preflight_flags = [], []
        return flags

    def note_flag(self, node: str, now: float) -> list[float]:
        """Remember a flag on ``node``; every flag time of it so far."""
        times = self.flag_times.setdefault(node, [])
        times.append(now)
        return times

    # --------------------------------------------------------------- preflight
    def add_preflight(self, node: str, report: keel_pb2.PreflightReport, step: int) -> None:
        """Keep each node's slowest rank per collective and size; nodes newly found far
        below their peers are flagged (``slow_flags``)."""
        mine = self.preflight.setdefault(node, {})
        for result in report.results:
            key = (result.collective, result.size_bytes)
            if key not in mine or result.busbw_gbps < mine[key].busbw_gbps:
                mine[key] = result
        for name in sorted(self.slow_preflight_nodes() - self.preflight_flagged):
            self.preflight_flagged.add(name)
            self.preflight_flags.append(SlowFlag(name, step, 0, preflight.SLOW_REASON))

    def slow_preflight_nodes(self) -> set[str]:
        """``policy.preflight.slow_nodes`` of the figures so far."""
        return preflight.slow_nodes(
            {
                node: {key: result.busbw_gbps for key, result in results.items()}
                for node, results in self.preflight.items()
            }
        )

    def preflight_status(self) -> list[keel_pb2.NodePreflight]:
        slow = self.slow_preflight_nodes()
        return [
            keel_pb2.NodePreflight(
                node=node,
                generation=self.generation,
                # Shown by collective name, then size.
                results=[
                    results[k]
                    for k in sorted(results, key=lambda k: (WIRE_COLLECTIVES.text(k[0]), k[1]))
                ],
                slow=node in slow,
            )
            for node, results in sorted(self.preflight.items())
        ]


def _samples(taken: list[tuple[str, list]]) -> Iterator[StepBlock]:
    """The straggler detector's samples of nodes' step tallies: a node's step each, of
    its ranks whose own time for the step was measured (a slow rank shows there, its
    healthy peers do not: it is taken before they wait on each other)."""
    for node, tallies in taken:
        for tally in tallies:
            ranks, times = tally.ranks, tally.step_times
            if min(times) <= 0:
                kept = [(rank, t) for rank, t in zip(ranks, times) if t > 0]
                if not kept:
                    continue
                ranks, times = tuple(r for r, _ in kept), tuple(t for _, t in kept)
            yield StepBlock(node, tally.step, ranks, times)


def _flag(flag: Flag) -> SlowFlag:
    return SlowFlag(
        flag.node, flag.flagged_at_step, flag.flagged_at_step - flag.slow_since_step, flag.reason
    )
