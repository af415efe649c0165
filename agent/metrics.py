"""The agent's Prometheus metrics (docs/metrics.md), its ranks' included: ranks open no
port; the agent exports what they report. Every series carries ``node``; the job's
series are labelled by the job whose generation the agent runs, and removed when it
runs another (labels stay bounded: one job per node at a time)."""

from __future__ import annotations

import math
import threading

from prometheus_client import Counter, Gauge, Histogram

from protos import keel_pb2

RANKS_RUNNING = Gauge("keel_agent_ranks_running", "Rank processes alive on this node", ["node"])
RANK_EXITS = Counter(
    "keel_agent_rank_exits",
    "Rank process exits: ok, failed (exit code), "
    "signal, stopped (by the agent), parked (left a failed generation alive "
    "to restart in place)",
    ["node", "outcome"],
)
CONTROLLER_CONNECTED = Gauge(
    "keel_agent_controller_connected", "1 while the agent's stream to the leader is up", ["node"]
)
LEASE_OK = Gauge("keel_agent_lease_ok", "1 while the agent's etcd lease is alive", ["node"])
HANGS = Counter("keel_agent_hangs", "Hangs this agent declared", ["node"])
REPLICATED_BYTES = Counter(
    "keel_agent_replicated_bytes",
    "Bytes of this node's memory snapshots whose copy its partner took whole",
    ["node"],
)
REPLICATION_SECONDS = Counter(
    "keel_agent_replication_seconds", "Seconds those copies took", ["node"]
)

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_SECONDS = Histogram(
    "keel_step_seconds",
    "Its ranks' step time by phase: step (the "
    "rank's own time), data, compute, optimizer, checkpoint; seconds",
    ["job_name", "node", "phase"],
    buckets=STEP_BUCKETS,
)
CHECKPOINT_BLOCKING = Histogram(
    "keel_checkpoint_blocking_seconds",
    "The training loop blocked by a checkpoint save, seconds",
    ["job_name", "node"],
    buckets=STEP_BUCKETS,
)
SAVE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
CHECKPOINT_SAVE = Histogram(
    "keel_checkpoint_save_seconds",
    "A checkpoint save from its start to its durable commit, seconds",
    ["job_name", "node"],
    buckets=SAVE_BUCKETS,
)
CHECKPOINT_LOAD = Histogram(
    "keel_checkpoint_load_seconds",
    "A rank's restore of a checkpoint, seconds",
    ["job_name", "node"],
    buckets=SAVE_BUCKETS,
)
CHECKPOINT_BYTES = Gauge(
    "keel_checkpoint_bytes",
    "Size of the newest checkpoint this node's rank 0 committed, bytes",
    ["job_name", "node"],
)
EXIT_OUTCOMES = ("ok", "failed", "signal", "stopped", "parked")
PHASES = {
    "step": "step_time_s",
    "data": "data_s",
    "compute": "compute_s",
    "optimizer": "optimizer_s",
    "checkpoint": "checkpoint_s",
}


def _seconds(value: float) -> bool:
    return math.isfinite(value) and value > 0


class RankSeries:
    """The series of what ``node``'s ranks report, for the job they run."""

    def __init__(self, node: str):
        self.node = node
        self.job = ""
        self.lock = threading.Lock()
        # The node's own series exist from the start, at 0.
        for outcome in EXIT_OUTCOMES:
            RANK_EXITS.labels(node, outcome)
        HANGS.labels(node)

    def _for(self, job: str) -> None:
        """Label what follows with ``job``, dropping the previous job's series."""
        if job == self.job:
            return
        if self.job:  # remove() passes over label values without a series
            for phase in PHASES:
                STEP_SECONDS.remove(self.job, self.node, phase)
            for metric in (CHECKPOINT_BLOCKING, CHECKPOINT_SAVE, CHECKPOINT_LOAD, CHECKPOINT_BYTES):
                metric.remove(self.job, self.node)
        self.job = job
        # Every series of the job at once: their number does not change while it runs.
        for phase in PHASES:
            STEP_SECONDS.labels(job, self.node, phase)
        for metric in (CHECKPOINT_BLOCKING, CHECKPOINT_SAVE, CHECKPOINT_LOAD):
            metric.labels(job, self.node)

    def steps(self, job: str, reports) -> None:
        with self.lock:
            self._for(job)
            for report in reports:
                for phase, name in PHASES.items():
                    value = getattr(report, name)
                    if _seconds(value):
                        STEP_SECONDS.labels(job, self.node, phase).observe(value)
                if _seconds(report.checkpoint_s):
                    CHECKPOINT_BLOCKING.labels(job, self.node).observe(report.checkpoint_s)
                if _seconds(report.restore_s):
                    CHECKPOINT_LOAD.labels(job, self.node).observe(report.restore_s)

    def checkpoint(self, job: str, saved: keel_pb2.CheckpointSaved) -> None:
        with self.lock:
            self._for(job)
            if _seconds(saved.save_s):
                CHECKPOINT_SAVE.labels(job, self.node).observe(saved.save_s)
            if saved.bytes:
                CHECKPOINT_BYTES.labels(job, self.node).set(saved.bytes)
