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


def memory_events(workdir: Path, node: str = "node-0") -> list[dict]:
    """The agent's memory records (held, released) of ``node``."""
    lines = (workdir / "logs" / f"agent-{node}.log").read_text().splitlines()
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
    # (No copy: the cluster has no other node to be its partner.)
    assert summary["last_memory_snapshot"] == {
        "step": 15,
        "generation": 2,
        "nodes": ["node-0"],
        "replica_step": 0,
        "replica_node": "",
    }
    assert summary["last_checkpoint"]["step"] == 16
    # The memory was the agent's, for the job, and went when the job ended.
    held, released = memory_events(run)
    assert held["event"] == "memory held for the job" and held["path"].startswith("/dev/shm/")
    assert released["event"] == "memory released" and released["bytes"] > 0
    assert "finished on this node" in released["reason"]
    assert not Path(held["path"]).exists()


# A job across two nodes, replicated across them (dp_replicate=2): DCP saves each chunk
# once, on one node or the other, and each node's copy also holds the chunks its rank was
# not given, so that a restore reads its own node's memory alone.
ACROSS = (
    *("--nodes", "2", "--slots-per-node", "1", "--steps", "12"),
    *("--layout", "dp_replicate=2"),
)


@pytest.fixture(scope="module")
def across_fault_free(tmp_path_factory) -> dict:
    """The run the two-node runs are held to: no fault, no memory tier."""
    summary = run_up(
        tmp_path_factory.mktemp("across-fault-free") / "run", *ACROSS, "--checkpoint-every", "50"
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    return summary


def test_a_job_across_two_nodes_restores_each_nodes_memory_after_a_crash(
    no_leaks, across_fault_free
):
    common = [*ACROSS, "--checkpoint-every", "50"]
    clean = across_fault_free
    run = no_leaks / "run"
    summary = run_up(
        run, *common, "--memory-budget-gb", "1", "--inject", "kill:rank=1,step=7", *EVERY_STEP
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["generations"], summary["restarts"]) == (2, 1)
    second = (run / "nodes" / "node-0" / "keel-up" / "gen2" / "rank0.err").read_text()
    restored = re.search(
        r"restoring the memory snapshot of step (\d+), newer than no durable checkpoint", second
    )
    # Killed as step 7 began: step 6's snapshot, or step 5's if step 6's copy had not
    # ended on both nodes.
    assert restored and int(restored.group(1)) in (5, 6), second[-3000:]
    assert min(steps_logged(run, 2)) == int(restored.group(1)) + 1
    assert summary["data"] == {"expected": 192, "consumed": 192, "duplicates": 0, "missing": 0}
    assert abs(summary["final_loss"] - clean["final_loss"]) <= 1e-5 * clean["final_loss"]
    snapshot = summary["last_memory_snapshot"]
    assert (snapshot["step"], snapshot["generation"], snapshot["nodes"]) == (
        11,
        2,
        ["node-0", "node-1"],
    )
    # Each node held its own memory for the job, and released it at the end.
    for node in ("node-0", "node-1"):
        held, released = memory_events(run, node)
        assert held["event"] == "memory held for the job"
        assert released["event"] == "memory released" and released["bytes"] > 0
        assert not Path(held["path"]).exists()


def test_a_node_of_a_job_across_nodes_lost_restores_the_durable_checkpoint_and_says_why(
    no_leaks, across_fault_free
):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *ACROSS,
        *("--spares", "1", "--checkpoint-every", "4", "--memory-budget-gb", "1"),
        *("--inject", "lose_node:node=1,step=6"),
        *EVERY_STEP,
        # Synchronous: a durable checkpoint is committed before the next step begins.
        "--no-async-checkpoint",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    # node-1's part of the snapshot went with it, and no partner held a copy: node-0's
    # part alone restores nothing, so the generation on node-0 and the spare reads
    # storage, and the reason says why.
    controller = (run / "logs" / "controller.log").read_text()
    why = re.search(
        r"held by node-1, which the new generation does not run on, and a snapshot of a job "
        r"across nodes is not copied to partners: it restores from step (\d+)",
        controller,
    )
    assert why, controller[-4000:]
    durable = int(why.group(1))
    second = (run / "nodes" / "node-0" / "keel-up" / "gen2" / "rank0.err").read_text()
    assert f"step_{durable:08d} at step={durable}" in second, second[-3000:]
    assert "restoring the memory snapshot" not in second
    assert summary["data"] == {"expected": 192, "consumed": 192, "duplicates": 0, "missing": 0}
    fault_free = across_fault_free["final_loss"]
    assert abs(summary["final_loss"] - fault_free) <= 1e-5 * fault_free
    # No copies of a job across nodes were sent.
    for node in ("node-0", "node-1", "node-2"):
        log = (run / "logs" / f"agent-{node}.log").read_text()
        assert "memory snapshot copy received" not in log


# A node lost with its memory: one node of two ranks, snapshotting every step, with spares
# its agent copies each snapshot to. keel up removes a lost node's memory, as losing the
# node would; the durable checkpoints (every 50 steps) never come before the loss.
LOST = ("--slots-per-node", "2", "--steps", "30", "--memory-budget-gb", "1")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> dict:
    """The run the lost-node runs are held to: no fault, no memory tier."""
    summary = run_up(
        tmp_path_factory.mktemp("fault-free") / "run",
        *("--nodes", "1", "--slots-per-node", "2", "--steps", "30", "--checkpoint-every", "50"),
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    return summary


def log_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def left_behind(run: Path, holder: str) -> dict:
    """The controller's one "memory snapshot left behind" of node-0's snapshot, whose
    copy on ``holder`` the next generation restores."""
    (left,) = [
        r
        for r in log_records(run / "logs" / "controller.log")
        if r.get("event") == "memory snapshot left behind"
    ]
    assert left["nodes"] == ["node-0"] and left["copy"][0::2] == ["node-0", holder], left
    return left


def restored_from_memory(run: Path, node: str, generation: int, durable: str = "") -> int:
    """The step of the memory snapshot ``generation``'s rank 0 restored on ``node``,
    newer than the durable checkpoint ``durable`` (a pattern of its directory's name;
    "": none)."""
    err = (run / "nodes" / node / "keel-up" / f"gen{generation}" / "rank0.err").read_text()
    than = f"the durable checkpoint \\S*{durable}" if durable else "no durable checkpoint"
    restored = re.search(rf"restoring the memory snapshot of step (\d+), newer than {than}", err)
    assert restored, err[-3000:]
    return int(restored.group(1))


def assert_exact(summary: dict, fault_free: dict, samples: int = 480) -> None:
    assert summary["data"] == {
        "expected": samples,
        "consumed": samples,
        "duplicates": 0,
        "missing": 0,
    }
    assert abs(summary["final_loss"] - fault_free["final_loss"]) <= 1e-5 * fault_free["final_loss"]


def test_a_lost_node_restores_on_the_spare_from_the_copy_its_partner_held(no_leaks, fault_free):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "1", "--spares", "1", *LOST, "--checkpoint-every", "50"),
        *("--inject", "lose_node:node=0,step=10"),
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["generations"], summary["restarts"]) == (2, 1)
    # node-1, the spare, was node-0's partner: it held the copy of node-0's newest
    # snapshot it had been sent, and generation 2 ran there and restored it.
    recorded = left_behind(run, "node-1")
    taken = [
        r
        for r in log_records(run / "logs" / "agent-node-1.log")
        if r.get("event") == "memory snapshot copy taken"
    ]
    assert len(taken) == 1, taken
    copied = taken[0]["step"]
    # The copy node-1 held: the one the controller last heard of, or a later one that
    # arrived before the loss was reported. (keel up kills the node once it sees step
    # 10; by then it may have run a few more.)
    assert 5 <= recorded["copy"][1] <= copied <= recorded["step"], (recorded, taken)
    assert restored_from_memory(run, "node-1", 2) == copied
    assert min(steps_logged(run, 2, "node-1")) == copied + 1
    controller = (run / "logs" / "controller.log").read_text()
    assert re.search(
        rf"restores the copy of step {recorded['copy'][1]}( or later)? on node-1 \(which it "
        r"runs on\)",
        controller,
    )
    assert_exact(summary, fault_free)
    # Generation 2 had no partner left (node-0 was lost): its snapshots have no copy.
    assert summary["last_memory_snapshot"] == {
        "step": 29,
        "generation": 2,
        "nodes": ["node-1"],
        "replica_step": 0,
        "replica_node": "",
    }
    # keel up gave back every simulated node's memory, the lost one's too.
    (held,) = [r for r in memory_events(run) if r["event"] == "memory held for the job"]
    assert not Path(held["path"]).exists()


def test_a_replacement_fetches_the_copy_from_a_partner_in_another_failure_domain(
    no_leaks, fault_free
):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "1", "--spares", "2", *LOST, "--checkpoint-every", "50"),
        *("--failure-domains", "rack-a,rack-a,rack-b"),
        *("--inject", "lose_node:node=0,step=10"),
        # Agents send and fetch the copies over mutual TLS, each checking that the
        # node it was told of answers.
        "--tls",
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert summary["generations"] == 2
    # node-0's partner was node-2, the spare outside its rack; generation 2 was placed
    # on node-1 (the first free node), whose agent fetched the copy from node-2's.
    assert "memory snapshot not replicated" not in (run / "logs" / "agent-node-0.log").read_text()
    fetched = [
        r
        for r in log_records(run / "logs" / "agent-node-1.log")
        if r.get("event") == "memory snapshot copy fetched"
    ]
    assert len(fetched) == 1 and fetched[0]["holder"] == "node-2", fetched
    assert fetched[0]["of_node"] == "node-0" and fetched[0]["bytes"] > 0
    copied = fetched[0]["step"]
    recorded = left_behind(run, "node-2")
    assert recorded["copy"][1] <= copied <= recorded["step"], (recorded, fetched)
    assert restored_from_memory(run, "node-1", 2) == copied
    assert min(steps_logged(run, 2, "node-1")) == copied + 1
    controller = (run / "logs" / "controller.log").read_text()
    assert re.search(
        rf"restores the copy of step {recorded['copy'][1]}( or later)? on node-2 \(fetched "
        r"to node-1\)",
        controller,
    )
    assert_exact(summary, fault_free)
    # Generation 2's snapshots were copied to node-2 in turn; the copies went when the
    # job ended.
    last = summary["last_memory_snapshot"]
    assert last["nodes"] == ["node-1"] and last["replica_node"] == "node-2", last
    assert copied < last["replica_step"] <= last["step"], last
    released = [
        r
        for r in log_records(run / "logs" / "agent-node-2.log")
        if r.get("event") == "replicas released"
    ]
    assert released and released[-1]["bytes"] > 0, released


def test_a_node_lost_with_its_partner_falls_back_to_the_durable_checkpoint_and_says_so(
    no_leaks, fault_free
):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "1", "--spares", "2", *LOST, "--checkpoint-every", "4"),
        *("--inject", "lose_node:node=0,step=10", "--inject", "lose_node:node=1,step=10"),
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    # node-1 held node-0's copies and was lost with it: the generation on node-2
    # restored the durable checkpoint, and its reason says why.
    controller = (run / "logs" / "controller.log").read_text()
    lost_too = re.search(
        r"held by node-0, which the new generation does not run on, and its copy on node-1 "
        r"\(step (\d+)\) was lost too: it restores from step (\d+)",
        controller,
    )
    assert lost_too, controller[-4000:]
    durable = int(lost_too.group(2))
    assert durable % 4 == 0 and durable >= 8
    last = summary["generations"]
    err = (run / "nodes" / "node-2" / "keel-up" / f"gen{last}" / "rank0.err").read_text()
    assert "restoring the memory snapshot" not in err
    assert f"step_{durable:08d} at step={durable}" in err, err[-3000:]
    assert_exact(summary, fault_free)


def test_a_stalled_partner_costs_the_job_nothing_and_its_copies_resume_after(no_leaks):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "1", "--spares", "1", "--slots-per-node", "2", "--memory-budget-gb", "1"),
        # Steps enough to train on well past the stall (a step takes about 0.1 s here).
        *("--steps", "150", "--checkpoint-every", "50"),
        *("--inject", "stall_agent:node=1,step=5,for=8"),
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    # The partner's agent froze (as a frozen host's would: its kernel still takes the
    # connection): the job trained on, one generation, while node-0's agent said once
    # that its copies failed, and again once they went through.
    assert (summary["generations"], summary["restarts"]) == (1, 0)
    sender = log_records(run / "logs" / "agent-node-0.log")
    failed = [r for r in sender if r.get("event") == "memory snapshot not replicated"]
    again = [r for r in sender if r.get("event") == "memory snapshots replicated again"]
    assert len(failed) == 1 and failed[0]["partner"] == "node-1", failed
    assert len(again) == 1 and again[0]["step"] > failed[0]["step"], again
    last = summary["last_memory_snapshot"]
    assert (last["step"], last["nodes"], last["replica_node"]) == (149, ["node-0"], "node-1")
    assert again[0]["step"] <= last["replica_step"] <= 149
    assert summary["data"] == {"expected": 2400, "consumed": 2400, "duplicates": 0, "missing": 0}


# Steps enough for the partner's loss to be found (its lease's TTL, or the node-lost
# grace: 5 to 10 s) well before node-0's, where a step takes about 0.08 s. node-0 is
# lost 20 steps before a durable checkpoint (every 50): lost on one, the copy of that
# step is no newer than the checkpoint, which is then restored (CI saw it at 350).
PARTNER_STEPS = 400


@pytest.fixture(scope="module")
def partner_fault_free(tmp_path_factory) -> dict:
    """The run the lost-partner runs are held to: no fault, the same snapshots."""
    summary = run_up(
        tmp_path_factory.mktemp("partner-fault-free") / "run",
        *("--nodes", "1", "--slots-per-node", "2", "--steps", str(PARTNER_STEPS)),
        *("--checkpoint-every", "50", "--memory-budget-gb", "1", *EVERY_STEP),
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    return summary


@pytest.mark.parametrize(
    "faults",
    [
        ("lose_node:node=1,step=5", "lose_node:node=0,step=230"),
        # The leader is killed first: the standby that adopts the generation learns its
        # partner from node-0's Hello, and replaces it when it is lost. (Steps reported
        # while no controller leads reach keel up late: node-1 goes some steps after 60.)
        (
            "kill_leader:step=3",
            "lose_node:node=1,step=60",
            "lose_node:node=0,step=330",
            "--controllers",
            "2",
        ),
    ],
    ids=["one-leader", "after-failover"],
)
def test_a_lost_partner_is_replaced_and_a_node_lost_later_restores_the_new_partners_copy(
    no_leaks, partner_fault_free, faults
):
    """node-0's partner, node-1, is lost: the controller gives node-0 another partner,
    node-2, which is sent the newest snapshot at once and every one after. When node-0
    is lost later, the generation on node-2 restores node-2's copy, not the durable
    checkpoint before it (without the new partner, the copies of every snapshot after
    node-1's loss were lost: node-0's loss restored the durable checkpoint)."""
    flags = ("--slots-per-node", "2", "--steps", str(PARTNER_STEPS), "--memory-budget-gb", "1")
    run = no_leaks / "run"
    injected = [a for f in faults if ":" in f for a in ("--inject", f)]
    summary = run_up(
        run,
        *("--nodes", "1", "--spares", "2", *flags, "--checkpoint-every", "50"),
        *injected,
        *(f for f in faults if ":" not in f),
        *EVERY_STEP,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["generations"], summary["restarts"]) == (2, 1)
    controllers = [
        r for log in sorted((run / "logs").glob("controller*.log")) for r in log_records(log)
    ]
    (moved,) = [
        r
        for r in controllers
        if r.get("event") == "memory snapshot partner lost; copying to another"
    ]
    assert (moved["node"], moved["lost"], moved["partner"]) == ("node-0", "node-1", "node-2")
    assert moved["generation"] == 1
    told = [
        r
        for r in log_records(run / "logs" / "agent-node-0.log")
        if r.get("event") == "memory snapshots now copied to another partner"
    ]
    assert [(r["lost"], r["partner"]) for r in told] == [("node-1", "node-2")], told
    (left,) = [r for r in controllers if r.get("event") == "memory snapshot left behind"]
    assert left["nodes"] == ["node-0"] and left["copy"][0::2] == ["node-0", "node-2"], left
    (taken,) = [
        r
        for r in log_records(run / "logs" / "agent-node-2.log")
        if r.get("event") == "memory snapshot copy taken"
    ]
    copied = taken["step"]
    assert left["copy"][1] <= copied <= left["step"], (left, taken)
    # Newer than the durable checkpoint (every 50 steps), which it would have restored.
    assert restored_from_memory(run, "node-2", 2, durable=r"step_\d{8}") == copied
    assert min(steps_logged(run, 2, "node-2")) == copied + 1
    assert_exact(summary, partner_fault_free, samples=16 * PARTNER_STEPS)
