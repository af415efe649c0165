"""Gray failures: parties that stall or are cut off while they keep running, and what
they leave behind. Each test is named after what broke before Keel fenced it; each ends
with the job at its target, its data exact, no failed restore, and nothing of a
superseded generation left running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.local.ledger_check import audit_checkpoint
from tests.conftest import REPO, keel, wait_for
from tests.integration.test_control_plane import cluster  # noqa: F401  (fixture)
from tests.integration.test_keel_up import run_up

SCRIPTS = Path(__file__).parent / "scripts"

EXACT_40 = {"expected": 640, "consumed": 640, "duplicates": 0, "missing": 0}


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_a_stalled_leader_no_longer_keeps_its_agents_or_writes_when_it_wakes(no_leaks):
    run = no_leaks / "run"
    summary = run_up(run, "--controllers", "2", "--nodes", "2", "--slots-per-node", "1",
                     "--steps", "60", "--checkpoint-every", "10",
                     "--inject", "stall_leader:step=15,for=20")
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert "injected: leader controller" in summary["_stderr"]
    # Nothing restarted: the agents followed the standby within its node-lost grace,
    # and it adopted their ranks.
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (60, 1, 0)
    assert summary["leader_changes"] == 1 and summary["events"] == []
    assert summary["data"] == {"expected": 960, "consumed": 960, "duplicates": 0, "missing": 0}
    lines = [entry for name in ("controller.log", "controller-1.log")
             for entry in log_lines(run / "logs" / name)]
    leaders = {e["controller_id"]: e["term"] for e in lines if e["event"] == "leading"}
    assert len(leaders) == 2 and len(set(leaders.values())) == 2
    old = min(leaders, key=leaders.get)
    # The old leader woke superseded and stepped down; it led nothing after.
    assert any(e["event"] == "stepped down" and e.get("controller_id") == old for e in lines)
    for name in ("agent-node-0.log", "agent-node-1.log"):
        agent = log_lines(run / "logs" / name)
        connected = [e["term"] for e in agent if e["event"] == "connected to controller"]
        assert connected == sorted(leaders.values()), connected


TRAIN = [sys.executable, "-m", "trainer.train", "--global-batch", "4", "--no-preflight"]


def test_a_superseded_generation_that_runs_on_can_no_longer_commit_or_delete(no_leaks):
    """Generation 1 runs on (its node was lost to the cluster, but not stopped) while
    generation 2 starts on the same checkpoint directory. Before, generation 1 went on
    committing there, and its retention (keep 2) deleted generation 2's checkpoints,
    whose step numbers were lower; now its next commit is refused and it stops."""
    from common.procs import free_port
    from trainer import fence, manifest
    ckpt = no_leaks / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "KEEL_CHECKPOINT_DIR": str(ckpt), "KEEL_JOB": "fenced", "WORLD_SIZE": "1",
           "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    old = subprocess.Popen([*TRAIN, "--steps", "100000", "--checkpoint-every", "1",
                            "--keep-checkpoints", "2", "--no-async-checkpoint"], cwd=REPO,
                           text=True, env={**env, "KEEL_GENERATION": "1",
                                           "MASTER_PORT": str(free_port())},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: any(p.name.startswith("step_") for p in ckpt.iterdir())
                 if ckpt.is_dir() else False, 120, what="generation 1 committing")
        new = subprocess.run([*TRAIN, "--steps", "6", "--checkpoint-every", "2",
                              "--keep-checkpoints", "0"], cwd=REPO,
                             env={**env, "KEEL_GENERATION": "2", "MASTER_PORT": str(free_port())},
                             capture_output=True, text=True, timeout=240)
        assert new.returncode == 0, new.stderr[-3000:]
        stderr = old.communicate(timeout=120)[1]
    finally:
        if old.poll() is None:
            old.kill()
            old.communicate()
    assert old.returncode != 0, "generation 1 ran on"
    assert re.search(r"refusing to change checkpoint step \d+: generation 2 owns", stderr), \
        stderr[-3000:]
    assert fence.owner(str(ckpt)) == 2
    # Every checkpoint generation 2 committed is there, and whole.
    for step in (2, 4, 6):
        assert manifest.verify(str(ckpt / f"step_{step:08d}")) == "", step


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_restored(no_leaks):
    """Before, a restart crashed on the damaged checkpoint until its restarts ran out."""
    run = no_leaks / "run"
    newest = run / "checkpoints" / "step_00000010"
    stop = threading.Event()

    def damage():
        # Once step 10 is committed (its manifest is written before the rename), flip a
        # byte in its shard. Rank 1 hangs at step 12; in the seconds until the hang is
        # declared, step 10's commit (in the background) is recorded, so the restart
        # restores from it.
        while not stop.is_set():
            if (newest / "manifest.json").is_file():
                shard = newest / "__0_0.distcp"
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0xFF
                shard.write_bytes(bytes(data))
                return
            time.sleep(0.01)

    damager = threading.Thread(target=damage)
    damager.start()
    try:
        summary = run_up(run, "--nodes", "2", "--slots-per-node", "1", "--steps", "40",
                         "--checkpoint-every", "5", "--no-preflight",
                         "--hang-floor-s", "3", "--inject", "hang:rank=1,step=12")
    finally:
        stop.set()
        damager.join()
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (40, 2, 1)
    quarantined, = [e for e in summary["events"] if e["kind"] == "quarantined"]
    assert quarantined["step"] == 10 and "does not match its checksum" in quarantined["reason"]
    assert (run / "checkpoints" / ".quarantine.step_00000010.g2").is_dir()
    rank0 = (run / "nodes" / "node-0" / "keel-up" / "gen2" / "rank0.err").read_text()
    assert "resumed from" in rank0 and "step_00000005 at step=5" in rank0
    assert summary["data"] == EXACT_40


LOST_REPLY_SPEC = """\
name = "ambiguous"
world_size = 2
max_restarts = 0
checkpoint_dir = "{checkpoints}"
command = ["{python}", "-u", "-m", "trainer.train", "--steps", "30", "--checkpoint-every",
           "10", "--dim=32", "--layers=1", "--heads=2", "--vocab=64", "--seq-len=16",
           "--global-batch=4"]

[health]
preflight_off = true
straggler_policy = "alert"
"""


@pytest.mark.parametrize("state", ["STARTING", "RUNNING"])
def test_a_state_write_whose_reply_was_lost_no_longer_strands_the_job(cluster, etcd, state):  # noqa: F811
    """The controller's write of the job's move to ``state`` commits in etcd, but its
    reply is lost. Before, the job stayed RUNNING with nothing started (or STARTING on
    a placement nobody was asked to prepare) until it failed; now the controller
    rebuilds the job from etcd and tells the agents again until they run what etcd
    says, and the job completes without a restart."""
    cluster.controller(launcher=[str(SCRIPTS / "lost_reply_controller.py")],
                       env={"LOSE_REPLY_TO": state})
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="two nodes registered")
    spec = cluster.path / "ambiguous.toml"
    checkpoints = cluster.path / "checkpoints"
    spec.write_text(LOST_REPLY_SPEC.format(checkpoints=checkpoints, python=sys.executable))
    submitted = keel("submit", str(spec), "--etcd-endpoints", etcd.endpoint,
                     "--token-file", str(cluster.path / "token"), timeout_s=120)
    assert submitted.returncode == 0, submitted.stderr

    def ended():
        value = cluster.store.job_state("ambiguous").value
        return value if value and value["state"] in ("SUCCEEDED", "FAILED") else None

    final = wait_for(ended, 240, 0.2, what="the job to end")
    log = (cluster.path / "controller.log").read_text()
    assert f"lost the reply to the write of ambiguous {state}" in log
    assert "job rebuilt from etcd" in log
    assert (final["state"], final["generation"], final["restarts"]) == ("SUCCEEDED", 1, 0), final
    assert audit_checkpoint(checkpoints / "step_00000030") == {
        "expected": 120, "consumed": 120, "duplicates": 0, "missing": 0}
