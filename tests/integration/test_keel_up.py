"""`keel up` end to end: real etcd, controller, agents and torch.distributed ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from common.etcd import connect
from orchestrator.controller.store import Store
from tests.conftest import REPO, keel, processes_mentioning, step_events, wait_for

SCRIPT = REPO / "tests" / "integration" / "scripts" / "plain_allreduce.py"


def run_up(workdir: Path, *args: str, timeout_s: float = 300) -> dict:
    result = keel(
        "up",
        "--json",
        "--workdir",
        str(workdir),
        "--timeout-s",
        str(timeout_s),
        *args,
        timeout_s=timeout_s + 60,
    )
    assert result.stdout.strip(), f"no summary; stderr:\n{result.stderr[-4000:]}"
    summary = json.loads(result.stdout)
    summary["_rc"] = result.returncode
    summary["_stderr"] = result.stderr
    return summary


def test_a_torchrun_style_script_is_restarted_after_failing_once_and_completes(no_leaks, etcd):
    markers = no_leaks / "markers"
    markers.mkdir()
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "2",
        "--slots-per-node",
        "2",
        "--etcd-endpoints",
        etcd.endpoint,
        "--script",
        str(SCRIPT),
        "--",
        str(markers),
        "3",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert summary["state"] == "SUCCEEDED"
    assert (summary["generations"], summary["restarts"]) == (2, 1)
    (failure,) = summary["failures"]
    assert (failure["rank"], failure["exit_code"], failure["signal"]) == (1, 3, 0)
    # Every rank finished exactly once, in the restarted generation, at world size 4.
    for rank in range(4):
        assert (markers / f"done-{rank}").read_text() == "restart=1 world=4\n"
    # --etcd-endpoints: the state lives in the given etcd, and no embedded one ran.
    state = Store(connect([etcd.endpoint], 5)).job_state("keel-up").value
    assert (state.state, state.generation, state.restarts) == ("SUCCEEDED", 2, 1)
    assert not (no_leaks / "run" / "logs" / "etcd.log").exists()


def test_a_bad_fault_or_layout_is_refused_before_anything_starts(tmp_path):
    result = keel(
        "up", "--workdir", str(tmp_path / "run"), "--inject", "explode:rank=1,step=2", timeout_s=60
    )
    assert result.returncode == 2
    assert (
        "kind must be one of crash, hang, kill, kill_agent, kill_leader, lose_node, "
        "partition_node, restart_etcd, slow, stall_agent, stall_leader, stall_node" in result.stderr
    )
    assert not (tmp_path / "run" / "logs").exists()
    for layout, message in [
        ("pp=4", "pp=4 is more than layers=2"),
        ("dp_shard=2,tp=4", "spans 8 ranks but world_size is 4"),
        ("tp=8", "spans 8 ranks"),
    ]:
        result = keel("up", "--workdir", str(tmp_path / "run"), "--layout", layout, timeout_s=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert not (tmp_path / "run" / "logs").exists()


def steps_logged(workdir: Path, generation: int, node: str = "node-0") -> dict[int, float]:
    """step -> loss from rank 0's ``step`` log events in one generation (its stderr, on
    ``node``)."""
    err = workdir / "nodes" / node / "keel-up" / f"gen{generation}" / "rank0.err"
    return {step: event["loss"] for step, event in step_events(err.read_text()).items()}


def rank_starts(workdir: Path) -> dict[tuple[int, int], dict]:
    """(generation, rank) → the agent's ``rank started`` record (pid, warm, in_place)."""
    starts = {}
    for log in (workdir / "logs").glob("agent-*.log"):
        for line in log.read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "rank started":
                starts[(record["generation"], record["rank"])] = record
    return starts


def assert_restarted_in_place(starts: dict, generation: int, kept: set[int], replaced: set[int]):
    """Ranks ``kept`` of ``generation`` are the processes of the generation before it
    (restart in place); ranks ``replaced`` are new processes."""
    for rank in kept:
        now, before = starts[(generation, rank)], starts[(generation - 1, rank)]
        assert now["in_place"] and now["pid"] == before["pid"], (generation, rank, now, before)
    for rank in replaced:
        now = starts[(generation, rank)]
        assert not now["in_place"] and now["pid"] not in {
            r["pid"] for (g, _), r in starts.items() if g < generation
        }, (generation, rank, now)


def test_keel_up_trains_the_reference_model_at_world_size_4(no_leaks):
    summary = run_up(no_leaks / "run", "--nodes", "2", "--slots-per-node", "2", "--steps", "40")
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert summary["state"] == "SUCCEEDED"
    # What restarted it, should it ever (CI once saw world size 2 here, and no more).
    why = {k: summary[k] for k in ("generations", "restarts", "events", "failures")}
    assert (summary["steps"], summary["world_size"]) == (40, 4), why
    assert (summary["generations"], summary["restarts"]) == (1, 0), why
    # ln(256) ≈ 5.55 at the start; the stream's entropy floor is ln(2) ≈ 0.69.
    assert summary["initial_loss"] > 5.0
    assert summary["final_loss"] < 0.5 * summary["initial_loss"]
    assert summary["last_checkpoint"]["step"] == 40
    assert "step 40/40" in summary["_stderr"], "live progress was not shown"
    # A fault-free run flags nothing.
    assert summary["events"] == [], summary["events"]
    # Preflight: each node's figures for the three collectives, before step 1.
    assert sorted(p["node"] for p in summary["preflight"]) == ["node-0", "node-1"]
    for node in summary["preflight"]:
        assert {r["collective"] for r in node["results"]} == {
            "all_reduce",
            "all_gather",
            "reduce_scatter",
        }
        assert all(r["busbw_gbps"] > 0 and r["algbw_gbps"] > 0 for r in node["results"])


def test_a_crash_and_a_kill_are_each_recovered_from_the_committed_checkpoint(no_leaks):
    run = no_leaks / "run"
    summary = run_up(
        run,
        "--nodes",
        "2",
        "--slots-per-node",
        "2",
        "--steps",
        "40",
        "--checkpoint-every",
        "5",
        "--inject",
        "crash:rank=1,step=12",
        "--inject",
        "kill:rank=2,step=25",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (40, 3, 2)

    # The crash is reported with its traceback within a second of the exit.
    crash_event = next(e for e in summary["events"] if e["kind"] == "crash")
    assert crash_event["rank"] == 1 and crash_event["detected_after_s"] < 1.0
    assert "RuntimeError: injected crash at step 12 on rank 1" in crash_event["root_cause"]

    crash, kill = summary["failures"]
    assert (crash["generation"], crash["rank"], crash["node"], crash["exit_code"]) == (
        1,
        1,
        "node-0",
        1,
    )
    assert "RuntimeError: injected crash at step 12 on rank 1" in crash["traceback"]
    assert (kill["generation"], kill["rank"], kill["node"], kill["signal"]) == (2, 2, "node-1", 9)

    first, second, third = (steps_logged(run, g) for g in (1, 2, 3))
    # Each generation resumed right after a committed checkpoint, not from step 0: the
    # newest one (10, 20), or the one before it when the async save of the newest had
    # not been committed when the fault struck.
    assert min(second) - 1 in (5, 10) and min(third) - 1 in (15, 20), (min(second), min(third))
    assert max(third) == 40
    # The restored state is exact: the first step after a restore reproduces the loss
    # the failed generation computed for that same step from its in-memory state.
    assert abs(second[min(second)] - first[min(second)]) < 1e-4
    assert abs(third[min(third)] - second[min(third)]) < 1e-4
    assert third[40] < 0.5 * first[1]
    # Restart in place: the survivors of each failure became the next generation's
    # ranks in their own processes; the crashed rank (its own error) and the killed one
    # were replaced. The exact losses above are what those processes computed.
    starts = rank_starts(run)
    assert_restarted_in_place(starts, 2, kept={0, 2, 3}, replaced={1})
    assert_restarted_in_place(starts, 3, kept={0, 1, 3}, replaced={2})


def test_killing_keel_up_itself_leaves_no_process_behind(no_leaks):
    """SIGKILL gives keel up no chance to clean up: the kernel's parent-death signal
    must take down etcd, the controller and the agents, and theirs the ranks."""
    run = no_leaks / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "up",
            "--workdir",
            str(run),
            "--steps",
            "1000",
            "--checkpoint-every",
            "1000",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rank0 = run / "nodes" / "node-0" / "keel-up" / "gen1" / "rank0.err"

    def logged_step_2() -> bool:
        text = rank0.read_text() if rank0.exists() else ""
        return 2 in step_events(text[: text.rfind("\n") + 1])  # whole lines only: it is written to

    try:
        wait_for(logged_step_2, 120, what="training to start")
        # etcd, controller, 2 agents, 4 ranks (each rank's launcher has exec'd).
        assert len(processes_mentioning(str(run))) >= 8
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_for(
        lambda: not processes_mentioning(str(run)),
        30,
        what="every process of the killed keel up to exit",
    )


def test_restarts_across_two_layouts_consume_every_sample_exactly_once(no_leaks):
    """dp_shard=2,tp=2 at world size 4; a rank is killed (same layout again), then a
    node is lost with no spare, so the planner re-plans onto the surviving node and the
    trainers reshard the last committed checkpoint into the new layout."""
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "2",
        "--slots-per-node",
        "2",
        "--steps",
        "40",
        "--checkpoint-every",
        "5",
        "--layout",
        "dp_shard=2,tp=2",
        "--inject",
        "kill:rank=3,step=15",
        "--inject",
        "lose_node:node=1,step=25",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (40, 3, 2)
    assert summary["world_size"] == 2 and summary["layout"] != "dp_shard=2,tp=2"
    assert "node-1 lost" in summary["_stderr"]
    assert summary["data"] == {
        "expected": 40 * 16,
        "consumed": 40 * 16,
        "duplicates": 0,
        "missing": 0,
    }
    assert summary["final_loss"] < 0.5 * summary["initial_loss"]
    # The lost node's ranks died with its agent; node-0's two ranks restarted in place
    # into the smaller layout and resharded the checkpoint there.
    starts = rank_starts(no_leaks / "run")
    assert_restarted_in_place(starts, 2, kept={0, 1, 2}, replaced={3})
    assert_restarted_in_place(starts, 3, kept={0, 1}, replaced=set())


def test_the_reference_trainer_stuck_before_its_first_step_is_found_hung(no_leaks):
    """It attaches (trainer.runtime), so it is held to the first-step timeout; a plain
    script is not (test_keel_run)."""
    # The budget is kept well above a healthy start-up here, torch's import included.
    summary = run_up(
        no_leaks / "reference",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--steps",
        "2",
        "--hang-floor-s",
        "2",
        "--first-step-timeout-s",
        "12",
        "--no-preflight",
        "--inject",
        "hang:rank=1,step=1",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    hang = next(e for e in summary["events"] if e["kind"] == "hang")
    assert hang["rank"] == 1 and "first_step" in hang["reason"], hang


def test_a_sigtermed_agent_drains_its_node_and_a_sigtermed_leader_hands_over(no_leaks):
    """SIGTERM to an agent (what a scheduler sends a node it shuts down) drains its node
    like `keel drain`, rather than kill its ranks with no checkpoint: a checkpoint, then
    the job moves to the spare without spending a restart, and the agent exits."""
    summary = run_up(
        no_leaks / "run",
        "--controllers",
        "2",
        "--nodes",
        "2",
        "--spares",
        "1",
        "--slots-per-node",
        "1",
        "--steps",
        "60",
        "--checkpoint-every",
        "100",
        # The handover comes after the drain, which under load has taken
        # until step 36 (a handover inside a drain: test_gray_failures'
        # test_a_leader_that_takes_over_between_a_drains_stop_...), and
        # well before the end: keel up polls every 0.5 s, and under load
        # the last 5 steps of 45 ran between two polls.
        "--inject",
        "term_agent:node=1,step=10",
        "--inject",
        "term_leader:step=45",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["restarts"], summary["generations"]) == (60, 0, 2)
    replaced = next(e for e in summary["events"] if e["kind"] == "replaced")
    assert replaced["node"] == "node-1" and "node-2" in replaced["reason"], replaced
    assert summary["data"]["duplicates"] == 0 and summary["data"]["missing"] == 0
    logs = no_leaks / "run" / "logs"
    assert "draining the node before stopping" in (logs / "agent-node-1.log").read_text()
    # The only checkpoint before step 60 is the one the drain took, after step 10.
    second = [
        json.loads(line)
        for path in logs.glob("controller*.log")
        for line in path.read_text().splitlines()
        if '"to": "RUNNING"' in line and "generation 2:" in line
    ]
    assert second and "restoring step" in second[0]["reason"], second
    assert int(second[0]["reason"].rpartition("restoring step ")[2]) >= 10
    # The leader handed over: the standby took the lead, the job ran on (no restart).
    assert summary["leader_changes"] == 1
    assert "the lead is handed over" in "".join(p.read_text() for p in logs.glob("controller*.log"))


def test_three_single_slot_nodes_train_the_reference_model(no_leaks):
    """World size 3 trains the reference model, though its 16 samples a step do not
    split 3 ways: every sample once, the loss going down."""
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "3",
        "--slots-per-node",
        "1",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--no-preflight",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["state"], summary["world_size"], summary["steps"]) == ("SUCCEEDED", 3, 4)
    data = summary["data"]
    assert (data["expected"], data["duplicates"], data["missing"]) == (4 * 48, 0, 0), data
    assert summary["final_loss"] < summary["initial_loss"]

    # The same workdir again: its checkpoints are the first run's lineage; refused
    # before anything starts, with the two ways on.
    run, checkpoints = no_leaks / "run", no_leaks / "run" / "checkpoints"
    first = {p: p.read_bytes() for p in sorted(checkpoints.rglob("*")) if p.is_file()}
    args = ["--nodes", "3", "--slots-per-node", "1", "--checkpoint-every", "2", "--no-preflight"]
    again = keel("up", "--workdir", str(run), *args, "--steps", "4", timeout_s=60)
    assert again.returncode == 2, again.stderr
    assert f"{checkpoints} holds checkpoints of job keel-up (id " in again.stderr
    assert f"--resume-from {checkpoints}" in again.stderr
    # Resumed from them explicitly: a new lineage from step 4, written beside them;
    # the first run's files are read, never changed.
    resumed = run_up(run, *args, "--steps", "6", "--resume-from", str(checkpoints))
    assert resumed["_rc"] == 0, resumed["_stderr"][-4000:]
    assert (resumed["state"], resumed["steps"]) == ("SUCCEEDED", 6)
    assert resumed["last_checkpoint"]["path"].startswith(f"{run}/checkpoints-2/")
    assert f"writes its own in {run}/checkpoints-2" in resumed["_stderr"]
    rank0 = (run / "nodes" / "node-0" / "keel-up" / "gen1" / "rank0.err").read_text()
    assert f"resumed from {checkpoints}/step_00000004 at step=4" in rank0
    data = resumed["data"]
    assert (data["expected"], data["duplicates"], data["missing"]) == (6 * 48, 0, 0), data
    assert {p: p.read_bytes() for p in sorted(checkpoints.rglob("*")) if p.is_file()} == first


def test_a_hang_is_detected_within_its_timeout_and_the_stuck_rank_is_named(no_leaks):
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--steps",
        "20",
        "--checkpoint-every",
        "5",
        "--hang-floor-s",
        "3",
        "--inject",
        "hang:rank=1,step=8",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["restarts"]) == (20, 1)
    hang = next(e for e in summary["events"] if e["kind"] == "hang")
    assert hang["rank"] == 1 and hang["node"] == "node-1"
    # Declared after at least the 3 s timeout, and within a report flush of it.
    assert 3.0 <= hang["detected_after_s"] < 5.0, hang
    assert "inject_faults" in hang["stacks"]["1"], hang["stacks"]["1"][:2000]
    assert "rank 1 stopped in" in hang["root_cause"]
    assert "0" in hang["stacks"], "the waiting peer's stack is part of the report"


def test_a_slow_rank_is_flagged_and_its_node_replaced_by_the_spare(no_leaks):
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--spares",
        "1",
        "--steps",
        "40",
        "--checkpoint-every",
        "10",
        "--inject",
        "slow:rank=1,step=10,factor=1.5",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    kinds = [e["kind"] for e in summary["events"]]
    straggler = next(e for e in summary["events"] if e["kind"] == "straggler")
    assert straggler["node"] == "node-1"
    assert straggler["step"] - 10 <= 10 and straggler["detected_after_steps"] <= 10
    replaced = next(e for e in summary["events"] if e["kind"] == "replaced")
    assert replaced["node"] == "node-1" and "node-2" in replaced["reason"]
    assert kinds.count("straggler") == 1, summary["events"]
    assert (summary["steps"], summary["world_size"], summary["generations"]) == (40, 2, 2)


def test_a_node_that_crashes_every_generation_is_replaced_by_the_spare_after_the_second(
    no_leaks,
):
    run = no_leaks / "run"
    summary = run_up(
        run,
        *("--nodes", "2", "--slots-per-node", "1", "--spares", "1", "--no-preflight"),
        *("--steps", "4", "--checkpoint-every", "2", "--inject", "crash:node=0,step=2"),
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    # node-0's rank crashed in generations 1 and 2, where the spare node-2 waited...
    assert [(f["generation"], f["node"]) for f in summary["failures"]] == [
        (1, "node-0"),
        (2, "node-0"),
    ]
    (suspected,) = [e for e in summary["events"] if e["kind"] == "suspected"]
    assert suspected["node"] == "node-0" and suspected["reason"].startswith(
        "node node-0's ranks failed in generations 1 and 2: rank 0 "
    ), suspected
    assert "injected crash at step 2" in suspected["reason"]
    replaced = next(e for e in summary["events"] if e["kind"] == "replaced")
    assert replaced["reason"] == "node-0 replaced by node-2", replaced
    # ... so generation 3 ran without it, and finished.
    ran = {node.name for node in (run / "nodes").iterdir() if (node / "keel-up" / "gen3").is_dir()}
    assert ran == {"node-1", "node-2"}
    assert (summary["state"], summary["generations"], summary["steps"]) == ("SUCCEEDED", 3, 4)


def test_a_lost_node_is_replaced_by_the_spare(no_leaks):
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--spares",
        "1",
        "--steps",
        "30",
        "--checkpoint-every",
        "5",
        "--inject",
        "lose_node:node=1,step=10",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    lost = next(e for e in summary["events"] if e["kind"] == "node_lost")
    assert lost["node"] == "node-1"
    replaced = next(e for e in summary["events"] if e["kind"] == "replaced")
    assert replaced["node"] == "node-1" and "node-2" in replaced["reason"]
    assert (summary["steps"], summary["world_size"]) == (30, 2)
    assert summary["data"]["duplicates"] == 0 and summary["data"]["missing"] == 0


def test_a_killed_leader_is_replaced_by_the_standby_without_restarting_the_job(no_leaks):
    summary = run_up(
        no_leaks / "run",
        "--controllers",
        "2",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--steps",
        "60",
        "--checkpoint-every",
        "10",
        "--inject",
        "kill_leader:step=15",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (60, 1, 0)
    assert summary["leader_changes"] == 1
    # The standby leads within the 5 s leader lease plus a margin for its campaign
    # period, keel up's poll and a busy machine's scheduling delays.
    (failover,) = summary["failovers_s"]
    assert failover < 5.0 + 5.0, summary["failovers_s"]
    # The new leader reports the job's real start, stored in etcd, not its own first.
    assert summary["initial_loss"] > 5.0 and summary["final_loss"] < 0.5 * summary["initial_loss"]


def test_an_etcd_restart_mid_run_restarts_nothing(no_leaks):
    # Every member of a three-member etcd down for longer than the 5 s leader lease:
    # the controller cannot prove it leads, steps down, and leads again once etcd is
    # back with its key; the ranks may well finish meanwhile, and the agents' replayed
    # reports give it their last step.
    summary = run_up(
        no_leaks / "run",
        "--etcd-members",
        "3",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--steps",
        "40",
        "--checkpoint-every",
        "5",
        "--no-preflight",
        "--inject",
        "restart_etcd:step=10,down=7",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert "injected: etcd killed at step" in summary["_stderr"]
    assert "back after 7 s on its data" in summary["_stderr"]
    controller_log = (no_leaks / "run" / "logs" / "controller.log").read_text()
    assert "stepped down" in controller_log
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (40, 1, 0)
    assert summary["leader_changes"] == 0 and summary["events"] == []
    assert summary["final_loss"] < 0.5 * summary["initial_loss"]
    # Checkpoints taken while etcd was down were committed once it came back.
    assert summary["last_checkpoint"]["step"] == 40
    assert summary["data"] == {"expected": 640, "consumed": 640, "duplicates": 0, "missing": 0}


SCRIPT_WITH_HELPER = REPO / "tests" / "integration" / "scripts" / "stepper_with_helper.py"


def test_a_restarted_agent_kills_what_its_predecessor_left_and_the_job_goes_on(no_leaks):
    markers = no_leaks / "markers"
    markers.mkdir()
    summary = run_up(
        no_leaks / "run",
        "--nodes",
        "2",
        "--slots-per-node",
        "1",
        "--no-preflight",
        "--inject",
        "kill_agent:node=1,step=8",
        "--script",
        str(SCRIPT_WITH_HELPER),
        "--",
        str(markers),
        "20",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["state"], summary["generations"], summary["restarts"]) == ("SUCCEEDED", 2, 1)
    restarted = next(e for e in summary["events"] if e["kind"] == "agent_restarted")
    assert restarted["node"] == "node-1" and "rank(s) 1 of generation 1" in restarted["reason"]
    # Generation 1's helpers, moved out of their ranks' process groups, were all gone
    # before generation 2 started: node-1's killed by its new agent, node-0's by its
    # agent confirming the stop.
    assert sorted(p.name for p in markers.glob("helper-g1-*")) == ["helper-g1-r0", "helper-g1-r1"]
    for rank in (0, 1):
        assert (markers / f"alive-g2-r{rank}").read_text() == ""
