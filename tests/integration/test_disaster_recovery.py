"""Disaster recovery (docs/disaster-recovery.md) on a real etcd, controllers, agents and
trainer ranks: etcd restored from a snapshot taken mid-run, after the job went on to
later generations and terms, comes back with the job resuming from the last checkpoint
the snapshot recorded, in a new epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from common import keys
from common.epoch import first_generation
from tests.conftest import etcdctl, keel, wait_for
from tests.integration.conftest import TINY_TRAINER, stop

JOB = "dr"
TRAINER = [*TINY_TRAINER, "--no-preflight"]


def spec_file(path: Path, checkpoints: Path) -> Path:
    """One rank of the reference trainer, a checkpoint every 4 steps, far more steps
    than the test runs, every checkpoint kept: the etcd snapshot's newest one must be
    there when etcd is restored from it, however many the run commits meanwhile (with
    the default retention, a run that got more than three checkpoints past the snapshot
    before the kill deleted it, and the restored epoch had nothing to resume from)."""
    command = [*TRAINER, "--steps", "100000", "--checkpoint-every", "4", "--keep-checkpoints", "0"]
    out = path / f"{JOB}.toml"
    out.write_text(
        "\n".join(
            [
                f'name = "{JOB}"',
                "world_size = 1",
                "max_restarts = 20",
                "steps = 100000",
                f'checkpoint_dir = "{checkpoints}"',
                f"command = {json.dumps(command)}",
                "[health]",
                "preflight_off = true",
                "hang_floor_s = 60",
                'straggler_policy = "alert"',
            ]
        )
        + "\n"
    )
    return out


def log_events(log: Path, event: str) -> list[dict]:
    """The JSON log lines of ``event`` in a daemon's log."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            found.append(json.loads(line))
    return found


def test_a_restored_etcd_in_a_new_epoch_resumes_the_job_from_the_snapshots_checkpoint(
    cluster, etcd
):
    common = ["--etcd-endpoints", etcd.endpoint, "--token-file", str(cluster.path / "token")]
    cluster.controller()
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="two nodes registered")
    checkpoints = cluster.path / "checkpoints"
    submitted = keel("submit", str(spec_file(cluster.path, checkpoints)), *common, timeout_s=120)
    assert submitted.returncode == 0, submitted.stderr

    # 1. A checkpoint is recorded; the operator's periodic snapshot is taken.
    wait_for(lambda: cluster.store.checkpoints(JOB), 180, 0.2, what="a checkpoint recorded")
    snapshot = cluster.path / "etcd.snapshot"
    saved = subprocess.run(
        [*etcdctl(etcd.endpoint), "snapshot", "save", str(snapshot)], capture_output=True
    )
    assert saved.returncode == 0, saved.stderr

    # 2. The run goes on past the snapshot: a rank killed (generation 2), the controller
    # replaced (a new term), and more checkpoints recorded by generation 2.
    logs = [cluster.path / "node-a.log", cluster.path / "node-b.log"]
    (started,) = [e for log in logs for e in log_events(log, "rank started")]
    os.kill(started["pid"], signal.SIGKILL)

    def generation_2_checkpointed():
        return any(r.generation >= 2 for r in cluster.store.checkpoints(JOB))

    wait_for(generation_2_checkpointed, 180, 0.2, what="generation 2 to record a checkpoint")
    stop(cluster.controllers[0])
    cluster.controller(name="controller-2")
    recorded_by_2 = len(cluster.store.checkpoints(JOB))
    wait_for(
        lambda: len(cluster.store.checkpoints(JOB)) > recorded_by_2,
        180,
        0.2,
        what="a checkpoint recorded under the second controller",
    )
    seen_term = cluster.store.leader().term
    seen_generation = cluster.store.job_state(JOB).value.generation
    assert seen_generation >= 2
    fence = json.loads((checkpoints / ".fence").read_text())
    assert fence["generation"] == seen_generation

    # 3. Disaster: the controllers stop, etcd is restored from the snapshot.
    for proc in cluster.controllers:
        stop(proc)
    etcd.restore(snapshot)
    restored = cluster.store.checkpoints(JOB)
    assert restored, "the snapshot holds the first checkpoint record"
    last = restored[-1]
    assert cluster.store.job_state(JOB).value.generation == 1
    assert not any(r.generation >= 2 for r in restored)

    # 3a. Without a new epoch, a controller's term in the restored etcd is below what
    # the agents saw: they refuse it.
    cluster.controller(name="controller-no-epoch")
    unfenced = cluster.store.leader()
    assert unfenced.epoch == 0 and unfenced.term < seen_term, (unfenced, seen_term)
    wait_for(
        lambda: all(
            log_events(log, "refusing messages of a superseded controller") for log in logs
        ),
        60,
        0.2,
        what="both agents to refuse the restored etcd's leader of epoch 0",
    )
    stop(cluster.controllers[-1])

    # 4. keel restore-epoch, then a controller: the agents take it, and the job resumes
    # from the snapshot's last checkpoint in the epoch's first generation.
    ran = keel("restore-epoch", "--etcd-endpoints", etcd.endpoint, timeout_s=60)
    assert ran.returncode == 0, ran.stderr
    assert "epoch 1 set in etcd" in ran.stdout, ran.stdout
    assert f"resumes from {last.path} (step {last.step})" in ran.stdout, ran.stdout
    assert cluster.store.client.get(keys.LEADER)[0] is None
    refusals = {
        log: len(log_events(log, "refusing messages of a superseded controller")) for log in logs
    }
    cluster.controller(name="controller-3")
    leader = cluster.store.leader()
    assert leader.epoch == 1 and leader.term < seen_term, (leader, seen_term)

    def connected_in_epoch_1(log: Path) -> bool:
        return any(e.get("epoch") == 1 for e in log_events(log, "connected to controller"))

    wait_for(
        lambda: all(connected_in_epoch_1(log) for log in logs),
        60,
        0.2,
        what="both agents to take the leader of epoch 1",
    )
    first = first_generation(1)

    def resumed():
        state = cluster.store.job_state(JOB).value
        return state.state.value == "RUNNING" and state.generation >= first and state

    state = wait_for(resumed, 180, 0.2, what="the job to run in epoch 1")
    # RUNNING is stored when the generation is started, before an agent spawns its rank.
    rank0 = wait_for(
        lambda: next(iter(cluster.path.glob(f"node-*/{JOB}/gen{first}/rank0.err")), None),
        60,
        0.2,
        what=f"rank 0 of generation {first} to start",
    )
    resumed_line = wait_for(
        lambda: next((t for t in rank0.read_text().splitlines() if "resumed from" in t), None),
        120,
        0.2,
        what="rank 0 of epoch 1 to resume",
    )
    assert f"{Path(last.path).name} at step={last.step}" in resumed_line, resumed_line

    def recorded_in_epoch_1():
        return [r for r in cluster.store.checkpoints(JOB) if r.generation >= first]

    later = wait_for(recorded_in_epoch_1, 180, 0.2, what="a checkpoint of epoch 1 recorded")
    assert later[0].step > last.step
    assert json.loads((checkpoints / ".fence").read_text())["generation"] >= first
    # It did not crash-loop on Superseded: the first generation of the epoch still runs.
    assert cluster.store.job_state(JOB).value.generation == state.generation == first
    text = rank0.read_text()
    assert "Superseded" not in text and "superseded" not in text
    # And the agents refused nothing of the new leader.
    assert {
        log: len(log_events(log, "refusing messages of a superseded controller")) for log in logs
    } == refusals


def test_restore_epoch_advances_once_a_run_and_refuses_bad_input(etcd, tmp_path):
    endpoint = ["--etcd-endpoints", etcd.endpoint]
    first = keel("restore-epoch", *endpoint, timeout_s=60)
    assert first.returncode == 0, first.stderr
    assert "epoch 1 set in etcd" in first.stdout and "no jobs in the snapshot" in first.stdout
    second = keel("restore-epoch", *endpoint, timeout_s=60)
    assert "epoch 2 set" in second.stdout and "(the snapshot held epoch 1" in second.stdout
    chosen = keel("restore-epoch", *endpoint, "--epoch", "9", timeout_s=60)
    assert chosen.returncode == 0 and "epoch 9 set" in chosen.stdout, chosen.stderr
    lower = keel("restore-epoch", *endpoint, "--epoch", "5", timeout_s=60)
    assert lower.returncode == 2
    assert "holds epoch 9 already; give a higher one" in lower.stderr, lower.stderr

    closed = subprocess.run(  # a port nothing listens on
        [sys.executable, "-c", "from common import net; print(net.free_port('127.0.0.1'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    unreachable = keel("restore-epoch", "--etcd-endpoints", f"127.0.0.1:{closed}", timeout_s=60)
    assert unreachable.returncode == 1
    assert f"cannot reach etcd at 127.0.0.1:{closed}" in unreachable.stderr, unreachable.stderr
    misnamed = keel("restore-epoch", "--etcd-endpoints", "etcd-without-port", timeout_s=60)
    assert misnamed.returncode == 2 and "write it as host:port" in misnamed.stderr

    # A stored epoch that does not parse is not guessed at: --epoch is needed.
    etcd_client = etcdctl(etcd.endpoint)
    subprocess.run([*etcd_client, "put", keys.EPOCH, "garbage"], check=True, capture_output=True)
    unreadable = keel("restore-epoch", *endpoint, timeout_s=60)
    assert unreadable.returncode == 1 and "does not parse" in unreadable.stderr
    assert "give --epoch N" in unreadable.stderr
    fixed = keel("restore-epoch", *endpoint, "--epoch", "12", timeout_s=60)
    assert fixed.returncode == 0 and "epoch 12 set" in fixed.stdout, fixed.stderr
