"""Renders the controller's job and node series when Prometheus scrapes
(docs/metrics.md names and explains each).

Job series are not set as things happen: ``JobCollector`` renders them from the jobs
the controller holds at each scrape, so a controller that takes over exports every
job's state at its first scrape, one that steps down (and holds no jobs) exports none,
and an ended job's series go ``finished_job_metrics_s`` after it ended. Their counters
(restarts, tokens, goodput) are kept with the job in etcd and continue across leaders.
What is observed as it happens is ``metrics``'s histograms, created here for every
exported job (``metrics.known``)."""

from __future__ import annotations

import statistics
import time

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.wire_kinds import CheckpointProblemKind
from orchestrator.controller.goodput import BADPUT
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.metrics import known
from orchestrator.controller.state import ControllerState
from orchestrator.policy.job import RESTART_CAUSES
from orchestrator.policy.lifecycle import JobState

# Every kind at 0 from the job's start, so that `increase` sees the first of each.
PROBLEM_KINDS = tuple(kind.value for kind in CheckpointProblemKind)
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
            labels, job.progress.step
        )
        f.gauge(
            "keel_job_target_steps", "The job's step target (0: none)", ["job_name"]
        ).add_metric(labels, job.spec.steps)
        if job.progress.has_loss:
            f.gauge("keel_job_loss", "Rank 0's latest loss", ["job_name"]).add_metric(
                labels, job.progress.loss
            )
        f.counter("keel_job_tokens", "Tokens trained", ["job_name"]).add_metric(
            labels, job.progress.tokens
        )
        running = job.state is JobState.RUNNING
        rate = job.progress.tokens_per_s() if running else 0.0
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
            rank: statistics.median(times)
            for rank, times in job.progress.recent_rank_times().items()
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
                ).add_metric(labels, max(0.0, wall - last.recorded_at_unix))
        snapshot = job.last_memory_snapshot
        if snapshot:
            f.gauge(
                "keel_memory_snapshot_last_step",
                "Step of the newest memory snapshot every node of its generation committed",
                ["job_name"],
            ).add_metric(labels, snapshot.step)
            f.gauge(
                "keel_memory_snapshot_age_seconds",
                "Seconds since it was recorded",
                ["job_name"],
            ).add_metric(labels, max(0.0, wall - snapshot.recorded_at_unix))
            f.gauge(
                "keel_memory_snapshot_replica_step",
                "Step of the newest of its generation's snapshots whose copy is whole on a "
                "partner node (0: none)",
                ["job_name"],
            ).add_metric(labels, snapshot.replica_step)
        problems = f.counter(
            "keel_checkpoint_problems",
            "Checkpoints ranks would not use or could not save",
            ["job_name", "kind"],
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
