"""The memory tier on real ranks (``trainer.memory_tier``): a job snapshotting every step
into memory loses at most one step to a crash, where its durable checkpoints every 50
steps would lose all of them; the snapshot restores into a smaller, other layout; a
torn snapshot is passed over for the whole one before it; the data is consumed exactly
once and the losses are those of a run without the crash."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from orchestrator.local.ledger_check import audit as summarize
from tests.conftest import SCHEDULED_MODEL, committed_steps, crash_in_2d, step_losses, torchrun
from tests.integration.test_keel_up import run_up, steps_logged
from tests.integration.test_storage_faults import tmpfs
from trainer.memory_tier import committed, whole

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# The reference trainer's flag, after keel up's `--`: a snapshot after every step,
# whatever it costs on this machine.
EVERY_STEP = ("--", "--memory-overhead-max", "0")
FLAGS = [
    "-m",
    "trainer.train",
    "--steps",
    "10",
    "--checkpoint-every",
    "50",
    "--memory-checkpoint-every",
    "1",
    "--memory-overhead-max",
    "0",  # a snapshot after every step, whatever it costs on this machine
    *SCHEDULED_MODEL,
]


def test_a_crash_loses_one_step_and_restores_from_memory_into_another_layout(tmp_path: Path):
    ckpt, memory = tmp_path / "ckpt", tmp_path / "memory"
    memory.mkdir()
    reference, crashed = crash_in_2d(FLAGS, ckpt, KEEL_MEMORY_DIR=str(memory))
    assert "memory tier: snapshots every 1 steps" in crashed.stderr
    # No durable checkpoint before the crash; the memory holds step 8 alone (each
    # snapshot replaced the one before once it was committed).
    assert committed_steps(ckpt) == []
    assert sorted(committed(str(memory))) == [8]
    info, problem = whole(str(memory / "mem_00000008"))
    assert problem == "" and (info.step, info.samples, info.world_size) == (8, 8 * 16, 4)

    # Step 8's snapshot written by every rank but its commit cut off by the failure
    # (it overlaps the next step): whole, it is restored from its staging directory.
    # A snapshot torn mid-copy under a committed name (a shard file cut short), and a
    # staging directory that holds another step than its name says: neither is loaded.
    uncommitted = memory / ".mem_00000008.g0.tmp"
    (memory / "mem_00000008").rename(uncommitted)
    torn = memory / "mem_00000009"
    shutil.copytree(uncommitted, torn)
    info_file = torn / "snapshot.json"
    info_file.write_text(info_file.read_text().replace('"step": 8', '"step": 9'))
    shard = torn / "__2.mem"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    mislabeled = memory / ".mem_00000010.g0.tmp"
    shutil.copytree(uncommitted, mislabeled)
    assert "holds" in whole(str(torn))[1]

    resumed = torchrun(
        2,
        *FLAGS,
        "--layout",
        "pp=2",
        "--pp-schedule",
        "interleaved_1f1b",
        env={"KEEL_CHECKPOINT_DIR": str(ckpt), "KEEL_MEMORY_DIR": str(memory)},
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "restoring the memory snapshot of step 8, newer than no durable checkpoint" in (
        resumed.stderr
    )
    passed_over = (
        f"passing over memory snapshots: {mislabeled}: holds step 8; {torn}: __2.mem holds"
    )
    assert passed_over in resumed.stderr
    assert f"resumed from {uncommitted} at step=8" in resumed.stderr
    # The staging directories were tidied away (the whole one committed, then replaced
    # by the next snapshot); the last step's snapshot is not taken (the durable
    # checkpoint is), so step 9's stands.
    assert not uncommitted.exists() and not mislabeled.exists()
    assert sorted(committed(str(memory))) == [9]
    assert committed_steps(ckpt) == [10]

    ledger = json.loads((ckpt / "step_00000010" / "ledger.json").read_text())
    assert [entry[0] for entry in ledger["ranges"]] == list(range(1, 11))
    assert summarize(ledger["ranges"], 10 * 16) == {
        "expected": 160,
        "consumed": 160,
        "duplicates": 0,
        "missing": 0,
    }
    crashed_losses, resumed_losses = step_losses(crashed, check=False), step_losses(resumed)
    assert sorted(resumed_losses) == [9, 10]
    for step, loss in {**crashed_losses, **resumed_losses}.items():
        assert abs(loss - reference[step]) <= 1e-5 * loss + 1e-6, (step, loss, reference[step])


def test_the_default_bound_takes_snapshots_less_often_where_they_cost_more(tmp_path: Path):
    memory = tmp_path / "memory"
    memory.mkdir()
    flags = [flag for flag in FLAGS if flag not in ("--memory-overhead-max", "0")]
    flags[flags.index("--steps") + 1] = "40"
    done = torchrun(2, *flags, env={"KEEL_MEMORY_DIR": str(memory)})
    assert done.returncode == 0, done.stderr[-4000:]
    # On this machine a snapshot of the tiny reference model costs far more than 2 % of
    # its step (building the state dict alone does): the interval grows from 1.
    changes = re.findall(
        r"memory tier: a snapshot costs ([\d.]+) ms against ([\d.]+) ms steps; every (\d+) "
        r"steps \(was (\d+)\) to take at most 2.0% of the training time",
        done.stderr,
    )
    assert changes, done.stderr[-4000:]
    cost_ms, step_ms, interval, before = changes[0]
    assert before == "1" and int(interval) > 1
    assert int(interval) >= float(cost_ms) / (0.02 * float(step_ms))
    # The snapshot kept is the last one taken, at most one interval before the end.
    (kept,) = committed(str(memory))
    assert 40 - int(changes[-1][2]) <= kept < 40


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_memory_skips_the_snapshots_it_cannot_take_and_says_so_once(tmp_path: Path):
    # Room for one snapshot of this model (2.9 MB on two ranks), not for a second beside
    # it: every snapshot after the first fails on ENOSPC while training goes on.
    ckpt = tmp_path / "ckpt"
    flags = list(FLAGS)
    flags[flags.index("--steps") + 1] = "6"
    with tmpfs(tmp_path / "memory", size="4500k") as memory:
        done = torchrun(
            2, *flags, env={"KEEL_MEMORY_DIR": str(memory), "KEEL_CHECKPOINT_DIR": str(ckpt)}
        )
        assert done.returncode == 0, done.stderr[-4000:]
        said = re.findall(
            r"memory snapshot of step (\d+) not taken on this node \(\[Errno 28\] No space",
            done.stderr,
        )
        assert said == ["2"], done.stderr[-4000:]
        # The one taken stays whole, and nothing half written is left to fill the memory.
        assert os.listdir(memory) == ["mem_00000001"]
        assert whole(str(memory / "mem_00000001"))[1] == ""
    assert committed_steps(ckpt) == [6]


# --- under keel up: the agent holds the memory -------------------------------------------


def memory_events(workdir: Path) -> list[dict]:
    """The agent's memory records (held, released) of node-0."""
    lines = (workdir / "logs" / "agent-node-0.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if r.get("event", "").startswith("memory ")]


def test_a_killed_rank_restores_the_snapshot_its_agent_held_and_the_memory_goes_at_the_end(
    no_leaks,
):
    common = ["--nodes", "1", "--slots-per-node", "2", "--steps", "16", "--checkpoint-every", "50"]
    clean = run_up(no_leaks / "clean", *common)
    assert clean["_rc"] == 0, clean["_stderr"][-4000:]
    run = no_leaks / "run"
    summary = run_up(
        run, *common, "--memory-budget-gb", "1", "--inject", "kill:rank=1,step=9", *EVERY_STEP
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (16, 2, 1)
    second = (run / "nodes" / "node-0" / "keel-up" / "gen2" / "rank0.err").read_text()
    # Killed as step 9 began, while step 8's snapshot was being copied: step 8's is
    # restored where rank 1's copy had ended (its uncommitted staging directory is
    # whole), step 7's where it had not; at most one step is trained again, where the
    # durable checkpoint alone would lose all 8 (the first is at step 16).
    restored = re.search(
        r"restoring the memory snapshot of step (\d+), newer than no durable checkpoint", second
    )
    assert restored and int(restored.group(1)) in (7, 8), second[-3000:]
    assert min(steps_logged(run, 2)) == int(restored.group(1)) + 1
    assert summary["data"] == {"expected": 256, "consumed": 256, "duplicates": 0, "missing": 0}
    assert abs(summary["final_loss"] - clean["final_loss"]) <= 1e-5 * clean["final_loss"]
    # The controller recorded the newest snapshot every node committed: step 15's (none
    # follows the last step, whose durable checkpoint is saved), held by node-0.
    assert summary["last_memory_snapshot"] == {"step": 15, "generation": 2, "nodes": ["node-0"]}
    assert summary["last_checkpoint"]["step"] == 16
    # The memory was the agent's, for the job, and went when the job ended.
    held, released = memory_events(run)
    assert held["event"] == "memory held for the job" and held["path"].startswith("/dev/shm/")
    assert released["event"] == "memory released" and released["bytes"] > 0
    assert "finished on this node" in released["reason"]
    assert not Path(held["path"]).exists()


def test_a_job_across_two_nodes_takes_no_snapshots_and_says_why(no_leaks):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "2", "--slots-per-node", "1", "--steps", "12", "--checkpoint-every", "4"),
        *("--memory-budget-gb", "1", "--inject", "kill:rank=1,step=7"),
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert summary["generations"] == 2
    first, second = (
        (run / "nodes" / "node-0" / "keel-up" / f"gen{generation}" / "rank0.err").read_text()
        for generation in (1, 2)
    )
    # Each node would hold only its own rank's shards, which no restore could use: no
    # snapshot is taken (nor paid for), and the restart reads the durable checkpoint.
    off = "memory tier off: the job's 2 ranks are on more than one node (1 on this one)"
    assert off in first and off in second
    held, released = memory_events(run)
    assert released["event"] == "memory released" and released["bytes"] == 0
    assert "resumed from " in second and "step_00000004 at step=4" in second
    assert summary["data"] == {"expected": 192, "consumed": 192, "duplicates": 0, "missing": 0}
    assert summary["last_memory_snapshot"] is None


def test_a_snapshot_left_behind_on_a_lost_node_is_dropped_and_the_spare_reads_storage(no_leaks):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "1", "--spares", "1", "--slots-per-node", "2"),
        *("--steps", "40", "--checkpoint-every", "4", "--memory-budget-gb", "1"),
        *("--inject", "lose_node:node=0,step=10"),
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["generations"], summary["restarts"]) == (2, 1)
    # node-0 held the snapshots (its memory lost with it, as on a cluster): the record
    # went when generation 2 was placed on the spare, which restored from storage.
    controller = [
        json.loads(line)
        for line in (run / "logs" / "controller.log").read_text().splitlines()
        if line.startswith("{")
    ]
    (dropped,) = [r for r in controller if r.get("event") == "memory snapshot left behind"]
    # (Of a step at or after the injection's: keel up kills the node once it sees step
    # 10, by then node-0 may have run on a few steps.)
    assert dropped["nodes"] == ["node-0"] and dropped["step"] >= 9, dropped
    second = (run / "nodes" / "node-1" / "keel-up" / "gen2" / "rank0.err").read_text()
    assert "restoring the memory snapshot" not in second
    resumed = re.search(r"resumed from \S+/step_(\d{8}) at step=(\d+)", second)
    assert resumed and int(resumed.group(1)) == int(resumed.group(2)), second[-3000:]
    durable = int(resumed.group(2))
    assert durable % 4 == 0 and 8 <= durable <= dropped["step"]
    # The spare's own snapshots replaced it.
    assert summary["last_memory_snapshot"] == {"step": 39, "generation": 2, "nodes": ["node-1"]}
    assert summary["data"] == {"expected": 640, "consumed": 640, "duplicates": 0, "missing": 0}
    # keel up gave back every simulated node's memory, the lost one's too.
    (held,) = [r for r in memory_events(run) if r["event"] == "memory held for the job"]
    assert not Path(held["path"]).exists()
