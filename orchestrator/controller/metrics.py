"""The controller's Prometheus metrics (docs/metrics.md names and explains each).

Job series are not set as things happen: ``JobCollector`` renders them from the jobs
the controller holds when Prometheus scrapes, so a controller that takes over exports
every job's state at its first scrape, one that steps down (and holds no jobs) exports
none, and an ended job's series go ``finished_grace_s`` after it ended. Its counters
(restarts, tokens, goodput) are kept with the job in etcd and continue across leaders.
What is observed as it happens (detection latency, recovery times) is in histograms
labelled by job, removed the same way (``prune``)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from orchestrator.controller.goodput import BADPUT
from orchestrator.policy.job import RESTART_CAUSES
from orchestrator.policy.lifecycle import JobState
from protos import keel_pb2

if TYPE_CHECKING:  # the job's health record reports detections here
    from orchestrator.controller.job_runtime import JobRuntime
    from orchestrator.controller.state import ControllerState

LEADER = Gauge("keel_controller_leader", "1 while this controller leads, 0 on standby")
TERM = Gauge("keel_controller_term", "The leader term this controller leads under; 0 on standby")
LEADER_CHANGES = Counter(
    "keel_controller_leader_changes", "Times this controller took or lost the lead"
)
RECONCILE_TICK = Histogram(
    "keel_reconcile_tick_seconds",
    "One reconcile tick, seconds",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
AGENTS_DEFERRED = Counter(
    "keel_agent_connects_deferred",
    "Agent Connects refused RESOURCE_EXHAUSTED because the "
    "admission queue was full (the agent backs off and connects again)",
)
AGENT_MESSAGES_REFUSED = Counter(
    "keel_agent_messages_refused",
    "Agent messages refused because the plan does not let "
    "the node say them (see orchestrator.policy.authority)",
    ["kind"],
)
for _kind in keel_pb2.AgentMessage.DESCRIPTOR.oneofs_by_name["kind"].fields:
    AGENT_MESSAGES_REFUSED.labels(_kind.name)  # every kind at 0 from the start

SECONDS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
FAULT_DETECTION = Histogram(
    "keel_fault_detection_seconds",
    "From a fault to its detection, seconds",
    ["job_name", "kind"],
    buckets=SECONDS,
)
STRAGGLER_DETECTION = Histogram(
    "keel_straggler_detection_steps",
    "Steps from a node becoming slow to its flagging",
    ["job_name"],
    buckets=(5, 10, 15, 20, 30, 50, 100, 200, 500),
)
RECOVERY = Histogram(
    "keel_recovery_seconds",
    "From a fault to the first completed step of the next generation, seconds",
    ["job_name"],
    buckets=SECONDS,
)
RECOVERY_PHASE = Histogram(
    "keel_recovery_phase_seconds",
    "A recovery split into detect, stop, start, restore and first_step, seconds",
    ["job_name", "phase"],
    buckets=SECONDS,
)
DETECTED_KINDS = ("crash", "hang", "node_lost")
RECOVERY_PHASES = ("detect", "stop", "start", "restore", "first_step")
PROBLEM_KINDS = ("quarantined", "stale_commit")
NODE_STATES = ("ready", "spare", "cordoned", "draining", "lost")
TOP_RANKS = 8
# Peak dense bf16 FLOP/s per accelerator, matched as a case-insensitive substring of the
# name an agent reports (``--peak-flops NAME=FLOPS`` adds or overrides). None for CPUs:
# their MFU is not exported.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
    "MI300X": 1307e12,
}

_observed: dict[str, set[tuple[Histogram, tuple[str, ...]]]] = {}
_observed_lock = threading.Lock()


def _observe(histogram: Histogram, value: float | None, job: str, *labels: str) -> None:
    """Observe ``value`` (None: only create the series) in ``job``'s series."""
    child = histogram.labels(job, *labels)
    if value is not None:
        child.observe(max(0.0, value))
    with _observed_lock:
        _observed.setdefault(job, set()).add((histogram, (job, *labels)))


def known(job: str) -> None:
    """Create ``job``'s histogram series, empty: they exist (at 0) from its start, so
    that the first of anything shows as an increase, and their number never grows."""
    if job in _observed:
        return
    for kind in DETECTED_KINDS:
        _observe(FAULT_DETECTION, None, job, kind)
    _observe(STRAGGLER_DETECTION, None, job)
    _observe(RECOVERY, None, job)
    for phase in RECOVERY_PHASES:
        _observe(RECOVERY_PHASE, None, job, phase)


def forget(job: str) -> None:
    """Remove the histograms of ``job``."""
    with _observed_lock:
        for histogram, labels in _observed.pop(job, ()):
            histogram.remove(*labels)


def prune(exported: set[str]) -> None:
    """Remove the histograms of every job not in ``exported``."""
    with _observed_lock:
        gone = [job for job in _observed if job not in exported]
    for job in gone:
        forget(job)


def detected(job: str, kind: str, after_s: float, after_steps: int) -> None:
    """A fault of ``kind`` was detected (an event of the job's health record)."""
    if kind in DETECTED_KINDS:
        _observe(FAULT_DETECTION, after_s, job, kind)
    elif kind == "straggler":
        _observe(STRAGGLER_DETECTION, after_steps, job)


def recovered(job: JobRuntime) -> None:
    """If the job's new generation has completed its first step since a recovery
    began, observe the recovery and its phases, and end it."""
    recovery, first = job.recovery, job.goodput.first_step
    if (
        recovery is None
        or "started_at" not in recovery
        or first is None
        or first["end"] < recovery["started_at"]
    ):
        return
    job.recovery = None
    stopped = recovery.get("stopped_at", recovery["detected_at"])
    restore = min(first["restore_s"], max(0.0, first["end"] - recovery["started_at"]))
    phases = {
        "detect": recovery["detected_at"] - recovery["fault_at"],
        "stop": stopped - recovery["detected_at"],
        "start": recovery["started_at"] - stopped,
        "restore": restore,
        "first_step": first["end"] - recovery["started_at"] - restore,
    }
    _observe(RECOVERY, first["end"] - recovery["fault_at"], job.name)
    for phase, seconds in phases.items():
        _observe(RECOVERY_PHASE, seconds, job.name, phase)


def peak_flops(accelerator: str, peaks: dict[str, float]) -> float | None:
    """Peak FLOP/s of one ``accelerator`` (by name), or None if unknown."""
    name = accelerator.lower()
    matches = [(len(key), value) for key, value in peaks.items() if key.lower() in name]
    return max(matches)[1] if matches else None


def mfu(
    params: float, tokens_per_s: float, accelerators: list[str], peaks: dict[str, float]
) -> float | None:
    """Model FLOP/s utilization: 6 x params x tokens/s over the accelerators' summed
    peak; None when the parameter count or any accelerator's peak is unknown."""
    if params <= 0 or not accelerators:
        return None
    each = [peak_flops(a, peaks) for a in accelerators]
    if any(p is None for p in each):
        return None
    return 6 * params * tokens_per_s / sum(each)


def exported(state: ControllerState, wall: float) -> list[JobRuntime]:
    """The jobs whose series are exported at ``wall``: none unless leading; an ended
    job for ``finished_job_metrics_s`` after it ended (caller holds the state lock)."""
    if not state.is_leader:
        return []
    grace = state.config.finished_job_metrics_s
    return [
        job
        for _, job in sorted(state.jobs.items())
        if not job.state.terminal or job.ended_at_unix is None or wall - job.ended_at_unix < grace
    ]


class JobCollector(Collector):
    """Renders the job and node series from ``state`` at every scrape."""

    def __init__(self, state: ControllerState):
        self.state = state
        self.peaks = {**PEAK_FLOPS, **state.config.peak_flops}

    def describe(self):
        return []  # rendered at scrape time: nothing to check against other collectors

    def collect(self):
        wall = time.time()
        state = self.state
        families = _Families()
        with state.lock:
            jobs = exported(state, wall)
            for job in jobs:
                known(job.name)
                self._job(families, job, wall)
            if state.is_leader:
                families.gauge("keel_agents_connected", "Agents whose stream is up").add_metric(
                    [], state.connected()
                )
                families.gauge(
                    "keel_agent_report_interval_seconds",
                    "How long agents are asked to batch their step reports (0: at their own pace)",
                ).add_metric([], state.report_interval_s)
                nodes = families.gauge("keel_nodes", "Nodes by state", ["state"])
                counts = dict.fromkeys(NODE_STATES, 0)
                for name in set(state.registered) | set(state.sessions):
                    counts[self._node_state(name)] += 1
                for name, count in counts.items():
                    nodes.add_metric([name], count)
        yield from families.all()

    def _node_state(self, node: str) -> str:
        state = self.state
        session = state.sessions.get(node)
        if (
            session is None
            or not session.connected
            or any(node in job.lost_nodes for job in state.jobs.values())
        ):
            return "lost"
        placed = state.node_state(node)
        if placed != "ready":
            return "draining" if placed == "draining" else "cordoned"
        return "ready" if state.job_on(node) is not None else "spare"

    def _job(self, f: _Families, job: JobRuntime, wall: float) -> None:
        name = job.name
        labels = [name]
        states = f.gauge("keel_job_state", "1 for the job's lifecycle state", ["job_name", "state"])
        in_state = f.counter(
            "keel_job_state_seconds", "Seconds the job spent in each state", ["job_name", "state"]
        )
        for state in JobState:
            states.add_metric([name, state.value], 1 if job.state is state else 0)
            seconds = job.state_seconds.get(state.value, 0.0)
            if job.state is state and not state.terminal:
                seconds += max(0.0, wall - job.state_entered_at_unix)
            in_state.add_metric([name, state.value], seconds)
        f.gauge("keel_job_step", "Highest step rank 0 reported", ["job_name"]).add_metric(
            labels, job.step
        )
        f.gauge(
            "keel_job_target_steps", "The job's step target (0: none)", ["job_name"]
        ).add_metric(labels, job.spec.steps)
        if job.has_loss:
            f.gauge("keel_job_loss", "Rank 0's latest loss", ["job_name"]).add_metric(
                labels, job.loss
            )
        f.counter("keel_job_tokens", "Tokens trained", ["job_name"]).add_metric(labels, job.tokens)
        running = job.state is JobState.RUNNING
        rate = job.tokens_per_s() if running else 0.0
        f.gauge(
            "keel_job_tokens_per_second", "Tokens per second, latest reports", ["job_name"]
        ).add_metric(labels, rate)
        accelerators = [
            self.state.sessions[p.node].hello.accelerator
            for p in job.placement
            for _ in p.ranks
            if p.node in self.state.sessions
        ]
        utilization = mfu(job.spec.model.params, rate, accelerators, self.peaks)
        if utilization is not None and running:
            f.gauge("keel_job_mfu_ratio", "Model FLOP/s utilization", ["job_name"]).add_metric(
                labels, utilization
            )
        f.gauge("keel_job_world_size", "Ranks of the current generation", ["job_name"]).add_metric(
            labels, job.world_size or job.spec.world_size
        )
        f.gauge("keel_job_generation", "Current generation", ["job_name"]).add_metric(
            labels, job.generation
        )
        restarts = f.counter(
            "keel_job_restarts", "Generations ended, by cause", ["job_name", "cause"]
        )
        for cause in RESTART_CAUSES:
            restarts.add_metric([name, cause], job.restarts_by_cause.get(cause, 0))
        scores = f.gauge(
            "keel_job_straggler_score",
            "A node's slowest rank's step time over the latest window / the other nodes' median",
            ["job_name", "node"],
        )
        for score in job.health.straggler_state.scores:
            scores.add_metric([name, score.node], score.ratio)
        ranks = f.gauge(
            "keel_rank_step_seconds",
            f"Median own step time of the {TOP_RANKS} slowest ranks, latest steps",
            ["job_name", "rank"],
        )
        medians = {
            rank: statistics.median(times) for rank, times in job.recent_rank_times().items()
        }
        for rank in sorted(medians, key=lambda r: (-medians[r], r))[:TOP_RANKS]:
            ranks.add_metric([name, str(rank)], medians[rank])
        self._goodput(f, job)
        self._checkpoints(f, job, wall)

    @staticmethod
    def _goodput(f: _Families, job: JobRuntime) -> None:
        goodput, labels = job.goodput, [job.name]
        ratio = goodput.ratio()
        if ratio is not None:
            f.gauge(
                "keel_goodput_ratio", "Productive seconds / accounted seconds", ["job_name"]
            ).add_metric(labels, ratio)
        f.counter("keel_goodput_seconds", "Productive seconds", ["job_name"]).add_metric(
            labels, goodput.seconds["productive"]
        )
        badput = f.counter("keel_badput_seconds", "Seconds lost, by cause", ["job_name", "cause"])
        for cause in BADPUT:
            badput.add_metric([job.name, cause], goodput.seconds[cause])
        f.gauge(
            "keel_goodput_accounted_seconds",
            "Wall time accounted: productive plus badput",
            ["job_name"],
        ).add_metric(labels, goodput.accounted_s)
        f.gauge(
            "keel_goodput_at_risk_seconds",
            "Productive time of steps no checkpoint covers yet",
            ["job_name"],
        ).add_metric(labels, goodput.at_risk_s)

    @staticmethod
    def _checkpoints(f: _Families, job: JobRuntime, wall: float) -> None:
        labels = [job.name]
        last = job.last_checkpoint
        if last:
            f.gauge(
                "keel_checkpoint_last_step", "Step of the newest committed checkpoint", ["job_name"]
            ).add_metric(labels, last.step)
            if last.recorded_at_unix:
                f.gauge(
                    "keel_checkpoint_last_timestamp_seconds",
                    "When it was recorded, unix seconds",
                    ["job_name"],
                ).add_metric(labels, last.recorded_at_unix)
                f.gauge(
                    "keel_checkpoint_age_seconds", "Seconds since then", ["job_name"]
                ).add_metric(labels, max(0.0, wall - last["recorded_at"]))
        problems = f.counter(
            "keel_checkpoint_problems", "Checkpoints ranks would not use", ["job_name", "kind"]
        )
        for kind in PROBLEM_KINDS:
            problems.add_metric([job.name, kind], job.checkpoint_problem_counts.get(kind, 0))


class _Families:
    """Metric families by name, each made once per scrape, in the order first asked."""

    def __init__(self):
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, documentation: str, labels=()) -> GaugeMetricFamily:
        if name not in self._families:
            self._families[name] = GaugeMetricFamily(name, documentation, labels=labels)
        return self._families[name]

    def counter(self, name: str, documentation: str, labels=()) -> CounterMetricFamily:
        if name not in self._families:
            self._families[name] = CounterMetricFamily(name, documentation, labels=labels)
        return self._families[name]

    def all(self):
        return iter(self._families.values())


def register(state: ControllerState) -> JobCollector:
    """Export ``state``'s job and node series from this process's registry."""
    collector = JobCollector(state)
    REGISTRY.register(collector)
    return collector


def unregister(collector: JobCollector) -> None:
    REGISTRY.unregister(collector)
