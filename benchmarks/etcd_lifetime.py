"""A year of a 16,384-GPU job in etcd: does the database stay bounded?

The controller's real store code (``orchestrator.controller.store.Store``, the job's
events through ``JobHealth``, the checkpoint-record retention of ``policy.retention``)
drives a real etcd (``orchestrator.local.etcd_server``) through the writes of a year of
one job on 2,048 nodes of 8 GPUs, on a simulated clock:

* an interruption every 3 hours (Llama 3's rate on 16,384 GPUs: 419 in 54 days), each
  a generation: the job stopping, an event, the lost node's registration gone and a
  spare's registered, the lost node cordoned (uncordoned, repaired, a day later), the
  new plan written with the move to STARTING and again with RUNNING;
* a drain a day (the operation record, a drain cordon, a generation) and a straggler
  swap a day (events, a generation);
* a checkpoint every 30 minutes (its record; the oldest pruned past 16).

That is about 3,650 generations and 17,500 checkpoints. Keel's run compacts its etcd as
``keel up``'s does (``--auto-compaction-mode=periodic --auto-compaction-retention=1h``:
the benchmark compacts to the revision of one simulated hour before, every simulated
hour, and waits for etcd to finish, since a year does not pass in the run). The
baseline, on its own etcd in the same run, is what Keel did before: a plan per
generation never deleted, and no compaction. etcd's own gauges give the figures
(``etcd_mvcc_db_total_size_in_use_in_bytes`` and ``etcd_mvcc_db_total_size_in_bytes``
on its /metrics): the database in use at ten points of the year, and its growth per
generation over the second half, Keel's against the baseline's. The target is a flat
line: no growth per generation::

    python -m benchmarks.etcd_lifetime [--generations 3650] [--baseline-generations 3650]
"""

from __future__ import annotations

import argparse
import re
import time
import urllib.request
from dataclasses import dataclass

from common import keys, logs
from common.etcd import connect
from common.records import (
    CheckpointRecord,
    CordonRecord,
    EventRecord,
    GoodputRecord,
    JobSpecRecord,
    JobStateRecord,
    NodeRecord,
    OperationRecord,
    PlanRecord,
)
from orchestrator.controller.job_health import JobHealth
from orchestrator.controller.store import Store
from orchestrator.local.etcd_server import QUOTA_BACKEND_BYTES, EmbeddedEtcd, memory_backed_dir
from orchestrator.policy.event_kind import EventKind
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.retention import records_to_prune
from orchestrator.spec.health import resolve
from protos import keel_pb2

NODES, RANKS, SPARES = 2_048, 8, 64
HOUR = 3600.0
INTERRUPTION_S = 3 * HOUR
CHECKPOINT_S = 30 * 60.0
JOB = "pretrain"


class OldStore(Store):
    """The baseline: a generation's plan written as Keel wrote it before, one value,
    never deleted."""

    def _plan_ops(self, name: str, plan: PlanRecord) -> list:
        return [self._put(keys.plan(name, plan.generation), plan)]


@dataclass
class Sample:
    generation: int
    in_use: int
    total: int


def etcd_sizes(endpoint: str) -> tuple[int, int]:
    """(bytes in use, bytes of the file) of the etcd at ``endpoint``, from its metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()

    def gauge(name: str) -> int:
        return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))

    return (
        gauge("etcd_mvcc_db_total_size_in_use_in_bytes"),
        gauge("etcd_mvcc_db_total_size_in_bytes"),
    )


def node_name(i: int) -> str:
    return f"gpu-{i:05d}.rack-{i // 32:03d}.pod-{i // 1024}.train.example.com"


class Year:
    """One job's year of writes against one etcd, on a simulated clock."""

    def __init__(self, store: Store, endpoint: str, compact: bool, generations: int):
        self.store, self.endpoint, self.compact = store, endpoint, compact
        self.generations = generations
        self.client = store.client
        self.lease = self.client.lease(3600)
        self.active = [node_name(i) for i in range(NODES)]
        self.spares = [node_name(NODES + i) for i in range(SPARES)]
        self.health = JobHealth(JOB, resolve(keel_pb2.HealthSpec()))
        self.checkpoints: list[CheckpointRecord] = []
        self.cordoned: list[tuple[float, str]] = []  # (uncordon at, node)
        self.hourly: list[tuple[float, int]] = []  # (simulated time, revision then)
        self.now = 0.0
        self.step = 0
        self.revision = 0
        self.samples: list[Sample] = []
        self.nospace_at: int | None = None

    def _state(self, state: JobState, generation: int) -> JobStateRecord:
        return JobStateRecord(
            state=state,
            generation=generation,
            restarts=generation - 1,
            reason=f"generation {generation}",
            failures=[],
            initial_loss=None,
            stop_requested="",
            stop_now=False,
            planned_stop=False,
            ended_at_unix=None,
            goodput=GoodputRecord(
                start_unix=0.0,
                cursor_unix=self.now,
                seconds={"productive": self.now * 0.9, "restart": self.now * 0.1},
                phase="running",
                ran=True,
                ended=False,
                at_risk=[(self.step, 600.0)],
                generation=generation,
                world_size=NODES * RANKS,
                last_step=self.step,
            ),
            restarts_by_cause={"node_lost": generation - 1},
            checkpoint_problems={},
            state_seconds={state.value: 1.0},
            state_entered_at_unix=self.now,
            tokens=self.step * 2048 * 8192,
            step=self.step,
        )

    def _plan(self, generation: int, port: int) -> PlanRecord:
        return PlanRecord(
            generation=generation,
            world_size=NODES * RANKS,
            master_addr=self.active[0],
            master_port=port,
            nodes={n: list(range(i * RANKS, (i + 1) * RANKS)) for i, n in enumerate(self.active)},
            restore_from=self.checkpoints[-1].path if self.checkpoints else "",
            restore_fallbacks=[c.path for c in self.checkpoints[-3:-1]],
            command=["torchrun", "train.py", "--config", "llama-405b.toml"],
            mesh=f"dp_shard={NODES * RANKS // 64},tp=8,pp=8",
            agents={n: 100_000 + i for i, n in enumerate(self.active)},
            created_at_unix=self.now,
        )

    def _events(self) -> None:
        health = self.health
        self.store.put_events(
            JOB, [(seq, EventRecord(event=e)) for seq, e in sorted(health.unsaved.items())]
        )
        health.unsaved.clear()
        if health.dropped:
            self.store.delete_events(JOB, health.dropped)
            health.dropped.clear()

    def _transition(self, state: JobState, generation: int, plan: PlanRecord | None = None):
        self.revision = self.store.update_job_state(
            JOB, self._state(state, generation), self.revision, plan
        )

    def _generation(self, generation: int, cause: str) -> None:
        """The job stops, is planned again on a spare in place of one node, and runs."""
        lost = self.active[generation % NODES]
        spare = self.spares.pop(0)
        self.active[generation % NODES] = spare
        kind = {"interruption": EventKind.NODE_LOST, "drain": EventKind.OPERATOR}.get(
            cause, EventKind.STRAGGLER
        )
        self.health.event(kind, f"{cause}: {lost}", node=lost, step=self.step)
        self.health.event(EventKind.REPLACED, f"{lost} replaced by {spare}", node=spare)
        self._transition(JobState.STOPPING, generation - 1)
        self._events()
        if cause == "drain":
            self.store.put_operation(
                JOB,
                OperationRecord(
                    node=lost, reason="operator: drain", policy="replace", generation=generation
                ),
            )
        self.client.delete(keys.node(lost))  # its lease expired, or it was drained
        self.store.put_node(
            spare, NodeRecord(host=spare, slots=RANKS, pid=1, lease_id=self.lease.id), self.lease.id
        )
        self.store.cordon(
            lost,
            CordonRecord(reason=f"{cause}", by="policy", drain=cause == "drain", at_unix=self.now),
        )
        self.cordoned.append((self.now + 24 * HOUR, lost))
        self._transition(JobState.PENDING, generation - 1)
        self._transition(JobState.STARTING, generation, self._plan(generation, 0))
        self._transition(JobState.RUNNING, generation, self._plan(generation, 29500))
        if cause == "drain":
            self.store.delete_operation(JOB)

    def _checkpoint(self, generation: int) -> None:
        self.step += 1800
        record = CheckpointRecord(
            step=self.step,
            path=f"/ckpt/{JOB}/step_{self.step:09d}",
            generation=generation,
            samples=self.step * 2048,
            recorded_at_unix=self.now,
        )
        self.store.record_checkpoint(JOB, record)
        self.checkpoints.append(record)
        doomed = records_to_prune(self.checkpoints, {record.path})
        if doomed:
            self.store.delete_checkpoints(JOB, doomed)
            self.checkpoints = [c for c in self.checkpoints if c.step not in set(doomed)]

    def _repairs(self) -> None:
        while self.cordoned and self.cordoned[0][0] <= self.now:
            _, node = self.cordoned.pop(0)
            self.store.uncordon(node)
            self.spares.append(node)
            self.store.put_node(
                node,
                NodeRecord(host=node, slots=RANKS, pid=1, lease_id=self.lease.id),
                self.lease.id,
            )

    def _compaction(self) -> None:
        """As etcd's periodic compactor with a retention of an hour: to the revision of
        an hour before, each hour (simulated)."""
        revision = self.client.get_response(keys.LEADER).header.revision
        self.hourly.append((self.now, revision))
        while self.compact and len(self.hourly) > 1 and self.hourly[1][0] <= self.now - HOUR:
            self.hourly.pop(0)
        if self.compact and self.hourly[0][0] <= self.now - HOUR:
            # Waiting for etcd to finish compacting (physical): in the run an hour is a
            # tenth of a second, and without the wait etcd's compactor (in batches,
            # pausing between them) fell behind the writes and the database grew; in
            # a real hour it finishes with the hour to spare.
            self.client.compact(self.hourly[0][1], physical=True)

    def run(self) -> None:
        store = self.store
        spec = JobSpecRecord(
            spec=keel_pb2.JobSpec(name=JOB, world_size=NODES * RANKS, command=["train.py"]),
            job_id="bench",
        )
        for node in self.active + self.spares:
            store.put_node(
                node,
                NodeRecord(host=node, slots=RANKS, pid=1, lease_id=self.lease.id),
                self.lease.id,
            )
        self.revision = store.create_job(JOB, spec, self._state(JobState.PENDING, 0))
        self._transition(JobState.STARTING, 1, self._plan(1, 0))
        self._transition(JobState.RUNNING, 1, self._plan(1, 29500))
        # A year's generations in order of time: interruptions every 3 h, a drain and a
        # straggler swap each day (at 7:30 and 19:30), checkpoints every 30 min.
        causes = []
        for hour3 in range(1, 2921):
            causes.append((hour3 * INTERRUPTION_S, "interruption"))
        for day in range(365):
            causes.append((day * 24 * HOUR + 7.5 * HOUR, "drain"))
            causes.append((day * 24 * HOUR + 19.5 * HOUR, "straggler swap"))
        causes.sort()
        causes = causes[: self.generations]
        every = max(1, len(causes) // 10)
        next_checkpoint, next_hour, generation = CHECKPOINT_S, HOUR, 1
        try:
            for index, (at, cause) in enumerate(causes):
                while min(next_checkpoint, next_hour) <= at:
                    if next_checkpoint <= next_hour:
                        self.now = next_checkpoint
                        self._checkpoint(generation)
                        next_checkpoint += CHECKPOINT_S
                    else:
                        self.now = next_hour
                        self._repairs()
                        self._compaction()
                        next_hour += HOUR
                self.now = at
                generation += 1
                self.health.new_generation(generation, {})
                self._generation(generation, cause)
                if (index + 1) % every == 0 or index + 1 == len(causes):
                    self.samples.append(Sample(generation, *etcd_sizes(self.endpoint)))
        except Exception as exc:
            if "database space exceeded" not in str(exc) and "NOSPACE" not in str(exc):
                raise
            self.nospace_at = generation
            self.samples.append(Sample(generation, *etcd_sizes(self.endpoint)))

    def growth_per_generation(self) -> float:
        """Bytes in use per generation over the second half of the samples."""
        half = self.samples[len(self.samples) // 2 :]
        if len(half) < 2:
            half = self.samples
        first, last = half[0], half[-1]
        return (last.in_use - first.in_use) / max(1, last.generation - first.generation)


def one_year(label: str, store_class: type[Store], compact: bool, generations: int) -> Year:
    flags = (f"--quota-backend-bytes={QUOTA_BACKEND_BYTES}",) if compact else ()
    with EmbeddedEtcd(data_parent=memory_backed_dir(), storage_flags=flags) as etcd:
        client = connect([etcd.endpoint], 60)
        store = store_class(client)
        store.campaign("bench", "bench:1", client.lease(3600).id)
        year = Year(store, etcd.endpoint, compact, generations)
        began = time.monotonic()
        year.run()
        took = time.monotonic() - began
        client.close()
    print(f"\n{label}: {year.samples[-1].generation} generations in {took:.0f} s")
    print("  generation   in use MiB   file MiB")
    for s in year.samples:
        print(f"  {s.generation:10d}   {s.in_use / 2**20:10.1f}   {s.total / 2**20:8.1f}")
    if year.nospace_at:
        print(f"  etcd refused every write (NOSPACE) at generation {year.nospace_at}")
    return year


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=3650, help="default: a year's")
    parser.add_argument(
        "--baseline-generations",
        type=int,
        default=None,
        help="the baseline's (default: --generations); its growth per generation is the figure",
    )
    args = parser.parse_args()
    logs.configure("benchmark", fmt="console", level="warning")  # not an event a line
    keel = one_year("Keel", Store, True, args.generations)
    baseline = one_year(
        "baseline (plans kept, no compaction)",
        OldStore,
        False,
        args.baseline_generations or args.generations,
    )
    grow, grew = keel.growth_per_generation(), baseline.growth_per_generation()
    print(
        f"\nin use at the end: Keel {keel.samples[-1].in_use / 2**20:.1f} MiB after "
        f"{keel.samples[-1].generation} generations; baseline "
        f"{baseline.samples[-1].in_use / 2**20:.1f} MiB after "
        f"{baseline.samples[-1].generation}"
    )
    print(
        f"growth per generation over the second half: Keel {grow / 1024:.1f} KiB, "
        f"baseline {grew / 1024:.1f} KiB, ratio {grow / grew:.3f} (target: 0, a flat line)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
