"""Goodput: where a job's wall time went, every second of it in exactly one bucket.

``Goodput`` keeps a cursor on the wall clock: each fact the controller learns (a state
transition, a step that every rank has reported, a checkpoint recorded) attributes the
time from the cursor up to it to one bucket and moves the cursor on, so the buckets add
up to the time accounted, by construction. Nothing here reads a clock or does I/O: the
caller passes wall-clock seconds (ranks' report times are clamped into order).

Buckets (``BUCKETS``; docs/metrics.md says the same for operators):

- ``productive``: steps whose work was kept. A step's time is the wall interval from the
  end of the previous step to its own end, less what it spent blocked by a checkpoint
  (``checkpoint``) and waiting for a rank slower than the straggler threshold
  (``straggler``: the slowest rank's own time above the other ranks' median, when
  it exceeds the job's straggler threshold).
- ``recompute``: productive time of steps after the checkpoint the next generation
  restored from: they are done again. Until a checkpoint covers a step its productive
  time is *at risk*, held apart, and counted nowhere yet; a recorded checkpoint settles
  it as productive, a restart from an older one as recompute, so that no bucket ever
  shrinks (they are exported as counters).
- ``waiting`` (pending for capacity), ``startup`` (until the job's first step ever
  starts), ``preflight`` (the collective sweep before a generation's first step),
  ``restart`` (from the last step of a generation that ended to the next one's first),
  ``shutdown`` (from the last step to the job's end).

Time after the cursor is *open*; it is attributed when the next fact closes it, or by
``commit_open`` while the job is pending or stopping (no later fact can change what that
time was). ``accounted_s`` therefore trails wall time by at most one step, or by the
start of a generation, while a job runs; once the job ends, it is its whole wall time.
"""

from __future__ import annotations

import copy
import statistics

from common.records import GoodputRecord
from orchestrator.policy.lifecycle import JobState

BUCKETS = (
    "productive",
    "waiting",
    "startup",
    "preflight",
    "restart",
    "recompute",
    "checkpoint",
    "straggler",
    "shutdown",
)
BADPUT = BUCKETS[1:]
RUNNING = "running"  # the phase while steps flow: steps attribute the open time
# At-risk entries kept before the oldest are merged (a merged entry settles only when a
# checkpoint covers its last step): bounded, in memory and in etcd.
MAX_AT_RISK = 128
# A step is closed once every rank of the generation reported it, or once a report two
# steps later arrived (a report was lost: waiting longer is futile).
LOST_REPORT_STEPS = 2


class Goodput:
    def __init__(self, submitted_at: float, straggler_slowdown: float):
        self.start = submitted_at
        self.cursor = submitted_at
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.phase = "startup"  # bucket of the open time (or RUNNING)
        self.ran = False  # a step was accounted: downtime is a restart now
        self.ended = False
        self.at_risk: list[list[float]] = []  # [last step, productive seconds], oldest first
        self.generation = 0
        self.world_size = 0
        self.last_step = 0  # newest step closed in this generation
        self.preflight_s = 0.0  # this generation's sweep, seconds
        self.first_step: dict | None = None  # this generation's first step, once closed
        self.slowdown = straggler_slowdown
        self._pending: dict[int, dict] = {}  # step -> what its reports said so far

    # ------------------------------------------------------------------ reading
    @property
    def accounted_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def at_risk_s(self) -> float:
        return sum(s for _, s in self.at_risk)

    def ratio(self) -> float | None:
        """Productive seconds over accounted seconds; None before any is accounted."""
        total = self.accounted_s
        return self.seconds["productive"] / total if total > 0 else None

    def copy(self) -> Goodput:
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def _down(self) -> str:
        return "restart" if self.ran else "startup"

    def _advance(self, t: float, bucket: str) -> None:
        t = max(t, self.cursor)
        self.seconds[bucket] += t - self.cursor
        self.cursor = t

    def on_state(
        self,
        t: float,
        state: JobState,
        *,
        stop_requested: bool = False,
        generation: int = 0,
        world_size: int = 0,
        restore_step: int | None = None,
    ) -> None:
        """The job entered ``state`` at ``t``. STARTING also gives the new generation,
        its world size and the step it restores from (None: none, a fresh start)."""
        if self.ended:
            return
        if state in (JobState.STOPPING, JobState.SUCCEEDED):
            self._flush(t)
        if state is JobState.SUCCEEDED:
            bucket = "shutdown"
        elif state is JobState.STOPPING:
            bucket = "shutdown" if stop_requested else self._down
        elif self.phase == RUNNING:  # no step closed what followed the last one
            bucket = self._down
        else:
            bucket = self.phase
        self._advance(t, bucket)
        if state is JobState.STARTING:
            self._restored(restore_step or 0)
            self.generation, self.world_size = generation, world_size
            self.last_step = restore_step or 0
            self.preflight_s, self.first_step = 0.0, None
            self._pending.clear()
        if state.terminal:
            self._end(keep=state is JobState.SUCCEEDED)
            return
        self.phase = (
            "shutdown"
            if state is JobState.STOPPING and stop_requested
            else (bucket if state is JobState.STOPPING else self._down)
        )

    def waiting(self, t: float, for_capacity: bool) -> None:
        """A pending job's latest decision at ``t``: it waits for free slots, or not
        (backing off after a failure, placing)."""
        if self.ended or self.phase == RUNNING:  # steps account for a running job
            return
        target = "waiting" if for_capacity else self._down
        if target != self.phase:
            self._advance(t, self.phase)
            self.phase = target

    def commit_open(self, t: float) -> None:
        """Attribute the open time up to ``t`` to the current phase: only while the job
        is pending or stopping, when no step can close it differently."""
        if not self.ended and self.phase != RUNNING:
            self._advance(t, self.phase)

    def _end(self, keep: bool) -> None:
        """The job ended: work no checkpoint covers was productive if it succeeded (the
        result is kept), else lost."""
        self.seconds["productive" if keep else "recompute"] += self.at_risk_s
        self.at_risk.clear()
        self.ended = True

    # --------------------------------------------------------------- checkpoints
    def settle(self, step: int) -> None:
        """A checkpoint of ``step`` is recorded: the steps it covers were productive."""
        kept = [entry for entry in self.at_risk if entry[0] <= step]
        self.seconds["productive"] += sum(s for _, s in kept)
        self.at_risk = [entry for entry in self.at_risk if entry[0] > step]

    def _restored(self, step: int) -> None:
        """The next generation restores ``step`` (0: starts afresh): steps after it
        are done again."""
        self.settle(step)
        self.seconds["recompute"] += self.at_risk_s
        self.at_risk.clear()

    # --------------------------------------------------------------------- steps
    def preflight(self, generation: int, wall_s: float) -> None:
        """A rank of ``generation`` spent ``wall_s`` in the preflight sweep."""
        if generation == self.generation and wall_s > 0:
            self.preflight_s = max(self.preflight_s, wall_s)

    def steps(self, generation: int, tallies, now: float) -> None:
        """Steps of ranks of ``generation`` first sent (not replayed), a node's step at
        a time (``sessions.StepTally``: step, ranks, their own step times, at,
        checkpoint_s, restore_s); steps every rank has reported are closed, in order."""
        if self.ended or generation != self.generation:
            return
        pending, last = self._pending, self.last_step
        for tally in tallies:  # per node step: 4,000 a second at scale, 8 ranks each
            step = tally.step
            if step <= last:
                continue
            facts = pending.get(step)
            if facts is None:
                facts = pending[step] = {
                    "end": 0.0,
                    "own": [],
                    "checkpoint": 0.0,
                    "restore": 0.0,
                    "ranks": set(),
                }
            ranks, times = facts["ranks"], tally.step_times
            if not ranks.isdisjoint(tally.ranks):  # a rank's step sent again
                times = [t for r, t in zip(tally.ranks, times) if r not in ranks]
                if not times:
                    continue
            ranks.update(tally.ranks)
            facts["own"].extend(times if min(times) > 0 else [t for t in times if t > 0])
            if tally.at > facts["end"]:
                facts["end"] = tally.at
            if tally.checkpoint_s > facts["checkpoint"]:
                facts["checkpoint"] = tally.checkpoint_s
            if tally.restore_s > facts["restore"]:
                facts["restore"] = tally.restore_s
        while self._pending:
            step = min(self._pending)
            complete = (
                len(self._pending[step]["ranks"]) >= self.world_size
                or max(self._pending) >= step + LOST_REPORT_STEPS
            )
            if not complete:
                break
            self._close_step(step, now)

    def _flush(self, t: float) -> None:
        """The generation is over: close the steps reported so far."""
        for step in sorted(self._pending):
            self._close_step(step, t)

    def _close_step(self, step: int, now: float) -> None:
        facts = self._pending.pop(step)
        end = min(max(facts["end"], self.cursor), max(now, self.cursor))
        own = facts["own"]
        if self.phase != RUNNING:
            # The generation's first step: what came before it was start-up (or a
            # restart), its last part the preflight sweep.
            started = min(max(end - max(own, default=0.0), self.cursor), end)
            sweep = min(self.preflight_s, started - self.cursor)
            self._advance(started - sweep, self._down)
            self._advance(started, "preflight")
            self.phase, self.ran = RUNNING, True
            self.first_step = {
                "step": step,
                "started_at": started,
                "end": end,
                "restore_s": facts["restore"],
            }
        interval = end - self.cursor
        blocked = min(interval, facts["checkpoint"])
        excess = 0.0
        if len(own) >= 2:
            # Against the others' median, as the straggler detector judges: with two
            # ranks the median of all would be their mean.
            rest = sorted(own)[:-1]
            slowest, median = max(own), statistics.median(rest)
            if slowest > self.slowdown * median:
                excess = min(slowest - median, interval - blocked)
        self.seconds["checkpoint"] += blocked
        self.seconds["straggler"] += excess
        self.at_risk.append([step, interval - blocked - excess])
        if len(self.at_risk) > MAX_AT_RISK:
            (_, first), (last, second) = self.at_risk[0], self.at_risk[1]
            self.at_risk[:2] = [[last, first + second]]
        self.cursor = end
        self.last_step = step

    # ------------------------------------------------------------------ storage
    def record(self) -> GoodputRecord:
        """What etcd keeps (with the job's state, at each transition)."""
        return GoodputRecord(
            start_unix=self.start,
            cursor_unix=self.cursor,
            seconds=dict(self.seconds),
            phase=self.phase,
            ran=self.ran,
            ended=self.ended,
            at_risk=[tuple(e) for e in self.at_risk],
            generation=self.generation,
            world_size=self.world_size,
            last_step=self.last_step,
        )

    @classmethod
    def from_record(cls, record: GoodputRecord, straggler_slowdown: float) -> Goodput:
        goodput = cls(record.start_unix, straggler_slowdown)
        goodput.cursor = record.cursor_unix
        goodput.seconds.update({k: v for k, v in record.seconds.items() if k in BUCKETS})
        goodput.phase, goodput.ran = record.phase, record.ran
        goodput.ended = record.ended
        goodput.at_risk = [list(e) for e in record.at_risk]
        goodput.generation, goodput.world_size = record.generation, record.world_size
        goodput.last_step = record.last_step
        return goodput
