"""The controller's Prometheus metrics that are set as things happen (docs/metrics.md
names and explains each): leadership, the reconcile tick, agent admission, and what is
observed of a job as it happens (detection latency, recovery times) in histograms
labelled by job. A job's histograms go when its scrape-time series go (``prune``);
those series, rendered from the jobs the controller holds, are ``exporter``'s."""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

from common import keys
from orchestrator.controller.recovery import Recovery
from protos import keel_pb2

LEADER = Gauge("keel_controller_leader", "1 while this controller leads, 0 on standby")
TERM = Gauge("keel_controller_term", "The leader term this controller leads under; 0 on standby")
LEADER_CHANGES = Counter(
    "keel_controller_leader_changes", "Times this controller took or lost the lead"
)
LEADS_ABANDONED = Counter(
    "keel_controller_leads_abandoned",
    "Times this controller won the leader key, could not take the lead "
    "(its rebuild from etcd failed) and let the key go for a standby",
)
CERTIFICATE_REQUESTS = Counter(
    "keel_certificate_requests",
    "Nodes' certificate requests on the bootstrap port, by answer: issued (first or "
    "renewed), pending (an operator's approval awaited) or refused",
    ["answer"],
)
for _answer in ("issued", "pending", "refused"):
    CERTIFICATE_REQUESTS.labels(_answer)
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
RECORDS_SET_ASIDE = Counter(
    "keel_records_set_aside",
    "Stored values in etcd that did not parse as their key's record and were "
    "passed over (the value is left in etcd as it is)",
    ["record"],
)
for _record in keys.KINDS:
    RECORDS_SET_ASIDE.labels(_record)
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


def recovered(job: str, recovery: Recovery | None, first: dict | None) -> bool:
    """Whether ``job``'s new generation has completed its first step (``first``, the
    goodput's ``first_step``) since its ``recovery`` began; if so, observe the recovery
    and its phases, and the caller ends it. Times in wall-clock seconds."""
    if (
        recovery is None
        or recovery.started_at_unix is None
        or first is None
        or first["end"] < recovery.started_at_unix
    ):
        return False
    started = recovery.started_at_unix
    stopped = (
        recovery.stopped_at_unix
        if recovery.stopped_at_unix is not None
        else recovery.detected_at_unix
    )
    restore = min(first["restore_s"], max(0.0, first["end"] - started))
    phases = {
        "detect": recovery.detected_at_unix - recovery.fault_at_unix,
        "stop": stopped - recovery.detected_at_unix,
        "start": started - stopped,
        "restore": restore,
        "first_step": first["end"] - started - restore,
    }
    _observe(RECOVERY, first["end"] - recovery.fault_at_unix, job)
    for phase, seconds in phases.items():
        _observe(RECOVERY_PHASE, seconds, job, phase)
    return True
