"""The controller's job series, rendered from what it holds: as many series after
twenty generations and a thousand steps as after the first, none from a controller that
does not lead, none for a job ended longer ago than the grace; and MFU."""

import time

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from common.records import CordonRecord, MemorySnapshotRecord
from common.steps import summarize
from orchestrator.controller import exporter, metrics, sessions
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.recovery import Recovery
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.controller.store import Store
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.placement import NodeRanks
from protos import keel_pb2


def controller(**config) -> tuple[ControllerState, CollectorRegistry]:
    state = ControllerState(
        ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t", **config),
        Store(client=None),
    )
    state.is_leader = True
    registry = CollectorRegistry()
    registry.register(exporter.JobCollector(state))
    return state, registry


def job(name: str = "j", params: float = 0.0) -> JobRuntime:
    spec = keel_pb2.JobSpec(
        name=name, world_size=4, steps=10**6, model=keel_pb2.ModelShape(params=params)
    )
    return JobRuntime.new(spec, JobState.RUNNING, 1, 0.0)


def series(registry) -> list[tuple]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())))
        for family in registry.collect()
        for s in family.samples
    )


def histograms_of(name: str) -> list[tuple]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())))
        for family in REGISTRY.collect()
        for s in family.samples
        if s.labels.get("job_name") == name
    )


def run_generation(
    j: JobRuntime, generation: int, first_step: int, steps: int, now: float
) -> float:
    """Start ``generation`` on two nodes (a different second node each time) and report
    ``steps`` steps from each of its four ranks; the wall clock after it."""
    j.generation = generation
    j.placement = [NodeRanks("n0", (0, 1)), NodeRanks(f"n{generation}", (2, 3))]
    j.health.new_generation(generation, j.rank_nodes)
    j.progress.node_step_times.clear()
    j.recovery = Recovery(
        cause="crash",
        fault_at_unix=now - 3,
        detected_at_unix=now - 2,
        stopped_at_unix=now - 1,
    )
    j.goodput.on_state(
        now, JobState.STARTING, generation=generation, world_size=4, restore_step=first_step - 1
    )
    j.goodput.on_state(now, JobState.RUNNING)
    j.recovery.started_at_unix = now
    for step in range(first_step, first_step + steps):
        now += 1.0
        reports = [
            keel_pb2.StepReport(
                rank=r, step=step, loss=1.0, tokens=100, at=now, step_time_s=0.9 if r < 3 else 1.5
            )
            for r in range(4)
        ]
        for node, ranks in (("n0", {0, 1}), (f"n{generation}", {2, 3})):
            batch = keel_pb2.StepReportBatch(
                node_steps=summarize([r for r in reports if r.rank in ranks])
            )
            sessions._steps(j, generation, node, sessions._checked_steps(batch, ranks)[0])
        j.health.score_now()
    return now


def test_the_series_stay_as_many_as_steps_and_generations_grow():
    state, registry = controller()
    j = state.jobs["flat"] = job("flat")
    now, counts = time.time(), []
    for generation in range(1, 21):
        now = run_generation(j, generation, 50 * generation - 49, 50, now)
        counts.append((len(series(registry)), len(histograms_of("flat"))))
    assert len(set(counts)) == 1, counts
    # What the series say: the slow rank among the top ones, two nodes scored, the
    # recovery of each generation observed.
    exported = {name: labels for name, labels in series(registry)}
    assert exported["keel_job_step"] == (("job_name", "flat"),)
    scores = [labels for name, labels in series(registry) if name == "keel_job_straggler_score"]
    assert {dict(labels)["node"] for labels in scores} == {"n0", "n20"}
    recoveries = REGISTRY.get_sample_value("keel_recovery_seconds_count", {"job_name": "flat"})
    assert recoveries == 20


def value_of(registry, name: str, **labels) -> float | None:
    return next(
        (
            s.value
            for family in registry.collect()
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ),
        None,
    )


def test_the_slowest_ranks_series_is_each_ranks_median_over_its_nodes_latest_steps():
    state, registry = controller()
    j = state.jobs["j"] = job("j")
    j.generation = 1
    j.placement = [NodeRanks("n0", (0, 1)), NodeRanks("n1", (2, 3))]
    j.health.new_generation(1, j.rank_nodes)
    # Rank 1 slows down from step 6: only the latest five steps count, so its series
    # is its new pace. Rank 3's own time is not measured (0) in two of them.
    for step in range(1, 11):
        slow = 1.0 if step < 6 else 3.0
        own = 0.0 if step in (8, 9) else 1.5 + step / 100
        for node, ranks, times in (("n0", (0, 1), (1.0, slow)), ("n1", (2, 3), (2.0, own))):
            tally = sessions.StepTally(step, ranks, times, 10, time.time(), 0.0, 0.0, 1.0)
            sessions._steps(j, 1, node, [tally])
    medians = {
        rank: value_of(registry, "keel_rank_step_seconds", job_name="j", rank=str(rank))
        for rank in range(4)
    }
    assert medians == {0: 1.0, 1: 3.0, 2: 2.0, 3: pytest.approx(1.57)}  # of 1.56, 1.57, 1.60


def test_a_controller_that_does_not_lead_exports_no_job():
    state, registry = controller()
    state.jobs["j"] = job()
    assert any(name == "keel_job_state" for name, _ in series(registry))
    state.is_leader = False
    assert series(registry) == []


def test_an_ended_job_is_exported_for_the_grace_only():
    state, registry = controller(finished_job_metrics_s=60)
    old, recent = job("old"), job("recent")
    old.state, old.ended_at_unix = JobState.SUCCEEDED, time.time() - 61
    recent.state, recent.ended_at_unix = JobState.FAILED, time.time() - 5
    state.jobs.update(old=old, recent=recent)
    named = {dict(labels).get("job_name") for _, labels in series(registry)}
    assert named == {"recent", None}  # None: the node and agent series
    metrics.prune({"recent"})
    assert histograms_of("old") == [] and histograms_of("recent")


def test_nodes_are_counted_by_state():
    state, registry = controller()
    j = state.jobs["j"] = job()
    j.placement = [NodeRanks("a", (0, 1)), NodeRanks("b", (2, 3))]
    for name in ("a", "b", "c", "d", "e"):
        state.sessions[name] = AgentSession(
            node=name, host="h", slots=2, lease_id=1, pid=1, hello=keel_pb2.Hello(), term=1
        )
    state.sessions["e"].connected = False
    state.cordons["d"] = CordonRecord(drain=False, reason="r", by="operator", at_unix=0.0)
    nodes = {
        dict(labels)["state"]: value
        for family in registry.collect()
        for s in family.samples
        if s.name == "keel_nodes"
        for labels, value in [(s.labels, s.value)]
    }
    assert nodes == {"ready": 2, "spare": 1, "cordoned": 1, "draining": 0, "lost": 1}


@pytest.mark.parametrize(
    "accelerators, expected",
    [
        (["NVIDIA H100 80GB HBM3"] * 8, 6 * 1e9 * 1e5 / (8 * 989e12)),
        (["NVIDIA A100-SXM4-80GB"] * 4, 6 * 1e9 * 1e5 / (4 * 312e12)),
        (["NVIDIA H100 80GB HBM3", "cpu"], None),  # one unknown peak: no figure
        ([], None),
    ],
)
def test_mfu_is_model_flops_over_the_accelerators_peak(accelerators, expected):
    value = exporter.mfu(1e9, 1e5, accelerators, exporter.PEAK_FLOPS)
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_mfu_needs_the_parameter_count_and_takes_configured_peaks():
    assert exporter.mfu(0, 1e5, ["NVIDIA H100"], exporter.PEAK_FLOPS) is None
    peaks = {**exporter.PEAK_FLOPS, "MyChip": 1e15}
    assert exporter.mfu(1e9, 1e5, ["mychip v2"], peaks) == pytest.approx(6e14 / 1e15)
    # The longest matching name wins: "H100 NVL" is not an "H100" if both are known.
    assert exporter.peak_flops("NVIDIA H100 NVL", {"H100": 1.0, "H100 NVL": 2.0}) == 2.0


def test_mfu_is_exported_while_running_on_known_accelerators():
    state, registry = controller(peak_flops={"TestChip": 1e12})
    j = state.jobs["j"] = job(params=1e6)
    j.placement = [NodeRanks("a", (0,))]
    state.sessions["a"] = AgentSession(
        node="a",
        host="h",
        slots=1,
        lease_id=1,
        pid=1,
        hello=keel_pb2.Hello(accelerator="TestChip"),
        term=1,
    )
    j.progress.token_window.add(0.0, 0)
    j.progress.token_window.add(1.0, 1000)
    value = dict((s.name, s.value) for family in registry.collect() for s in family.samples)[
        "keel_job_mfu_ratio"
    ]
    assert value == pytest.approx(6 * 1e6 * 1000 / 1e12)


def test_the_newest_memory_snapshot_is_exported_beside_the_durable_checkpoint():
    state, registry = controller()
    j = state.jobs["j"] = job()

    def exported() -> dict[str, float]:
        return {
            s.name: s.value
            for family in registry.collect()
            for s in family.samples
            if s.name.startswith("keel_memory_snapshot_")
        }

    assert exported() == {}  # none yet: absent, not 0
    j.last_memory_snapshot = MemorySnapshotRecord(
        step=41,
        generation=1,
        samples=656,
        bytes=1 << 20,
        nodes=("a",),
        recorded_at_unix=time.time() - 30.0,
        replica_step=40,
        replica_node="b",
    )
    values = exported()
    assert values["keel_memory_snapshot_last_step"] == 41
    assert values["keel_memory_snapshot_replica_step"] == 40
    assert 30.0 <= values["keel_memory_snapshot_age_seconds"] < 300.0
