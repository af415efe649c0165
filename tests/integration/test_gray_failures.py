"""Gray failures: parties that stall or are cut off while they keep running, and what
they leave behind. Each test is named after the failure and what Keel does about it;
each ends with the job at its target, its data exact, no failed restore, and nothing of a
superseded generation left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.local.ledger_check import audit_checkpoint
from tests.conftest import REPO, committed_steps, keel, wait_for
from tests.integration.test_keel_up import run_up
from trainer import fence, verify

SCRIPTS = Path(__file__).parent / "scripts"

EXACT_40 = {"expected": 640, "consumed": 640, "duplicates": 0, "missing": 0}


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def assert_nothing_superseded_ran_on(run: Path) -> list[dict]:
    """Every rank any agent started had exited before the job succeeded (so nothing of
    a superseded generation ran on), and no generation but the first started fresh.
    Returns every agent log entry, oldest first."""
    entries = sorted(
        (
            {**e, "node": path.stem.removeprefix("agent-")}
            for path in (run / "logs").glob("agent-*.log")
            for e in log_lines(path)
        ),
        key=lambda e: e["timestamp"],
    )
    succeeded = next(
        e["timestamp"]
        for name in (run / "logs").glob("controller*.log")
        for e in log_lines(name)
        if e["event"] == "job state" and e.get("to") == "SUCCEEDED"
    )
    started = {(e["node"], e["pid"]): e for e in entries if e["event"] == "rank started"}
    exited = {(e["node"], e["pid"]): e for e in entries if e["event"] == "rank exited"}
    for key, start in started.items():
        assert key in exited and exited[key]["timestamp"] <= succeeded, (
            f"generation {start['generation']} rank {start['rank']} on {key[0]} ran on"
        )
    for generation in (run / "nodes").glob("*/keel-up/gen*"):
        err = generation / "rank0.err"
        if generation.name != "gen1" and err.exists():
            text = err.read_text()
            assert "resumed from" in text and "restore failed" not in text, text[-2000:]
    return entries


def test_a_stalled_leader_that_wakes_keeps_no_agents_and_leads_nothing(no_leaks):
    """The leader controller stalls for 20 s at step 15: the agents follow the standby
    within its node-lost grace and it adopts their ranks, so nothing restarts; the old
    leader wakes superseded, steps down and leads nothing after."""
    run = no_leaks / "run"
    summary = run_up(
        run,
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
        "stall_leader:step=15,for=20",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert "injected: leader controller" in summary["_stderr"]
    # Nothing restarted: the agents followed the standby within its node-lost grace,
    # and it adopted their ranks.
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (60, 1, 0)
    assert summary["leader_changes"] == 1 and summary["events"] == []
    assert summary["data"] == {"expected": 960, "consumed": 960, "duplicates": 0, "missing": 0}
    lines = [
        entry
        for name in ("controller.log", "controller-1.log")
        for entry in log_lines(run / "logs" / name)
    ]
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


def test_a_superseded_generation_that_runs_on_cannot_commit_or_delete(no_leaks):
    """Generation 1 runs on (its node was lost to the cluster, but not stopped) while
    generation 2 starts on the same checkpoint directory. Generation 1's next commit
    is refused and it stops: were it let commit, its retention (keep 2) would delete
    generation 2's checkpoints, whose step numbers are lower."""
    from common.net import free_port

    ckpt = no_leaks / "ckpt"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "KEEL_CHECKPOINT_DIR": str(ckpt),
        "KEEL_JOB": "fenced",
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }
    old = subprocess.Popen(
        [
            *TRAIN,
            "--steps",
            "100000",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "2",
            "--no-async-checkpoint",
        ],
        cwd=REPO,
        text=True,
        env={**env, "KEEL_GENERATION": "1", "MASTER_PORT": str(free_port("127.0.0.1"))},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: (
                any(p.name.startswith("step_") for p in ckpt.iterdir()) if ckpt.is_dir() else False
            ),
            120,
            what="generation 1 committing",
        )
        new = subprocess.run(
            [*TRAIN, "--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "0"],
            cwd=REPO,
            env={**env, "KEEL_GENERATION": "2", "MASTER_PORT": str(free_port("127.0.0.1"))},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert new.returncode == 0, new.stderr[-3000:]
        stderr = old.communicate(timeout=120)[1]
    finally:
        if old.poll() is None:
            old.kill()
            old.communicate()
    assert old.returncode != 0, "generation 1 ran on"
    assert re.search(r"refusing to change checkpoint step \d+: generation 2 owns", stderr), stderr[
        -3000:
    ]
    assert fence.owner(str(ckpt)) == 2
    # Every checkpoint generation 2 committed is there, and whole.
    for step in (2, 4, 6):
        verdict = verify.check_alone(str(ckpt / f"step_{step:08d}"))
        assert verdict.kind is verify.VerdictKind.OK, (step, verdict)


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_restored(no_leaks):
    """Step 10's shard is damaged after its commit and rank 1 hangs at step 12: the
    restart finds the checksum wrong, quarantines step 10 and restores step 5, and the
    job completes with its data exact in one restart."""
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
        summary = run_up(
            run,
            "--nodes",
            "2",
            "--slots-per-node",
            "1",
            "--steps",
            "40",
            "--checkpoint-every",
            "5",
            "--no-preflight",
            "--hang-floor-s",
            "3",
            "--inject",
            "hang:rank=1,step=12",
        )
    finally:
        stop.set()
        damager.join()
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["steps"], summary["generations"], summary["restarts"]) == (40, 2, 1)
    (quarantined,) = [e for e in summary["events"] if e["kind"] == "quarantined"]
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


def a_leader_a_standby_and_two_nodes(cluster, etcd) -> tuple[str, list[str]]:
    """Start them; the standby's address, and the CLI's flags to reach the cluster."""
    cluster.controller()
    standby = cluster.controller(name="standby", lead=False)
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="two nodes registered")
    return standby, ["--etcd-endpoints", etcd.endpoint, "--token-file", str(cluster.path / "token")]


def trainer_spec(directory: Path, name: str, steps: int, every: int, checkpoints: Path) -> Path:
    """``LOST_REPLY_SPEC`` as job ``name``, ``steps`` steps with a checkpoint every
    ``every``, written in ``directory``."""
    spec = directory / f"{name}.toml"
    spec.write_text(
        LOST_REPLY_SPEC.replace('"ambiguous"', f'"{name}"')
        .replace(
            '"30", "--checkpoint-every",\n           "10"',
            f'"{steps}", "--checkpoint-every",\n           "{every}"',
        )
        .format(checkpoints=checkpoints, python=sys.executable)
    )
    assert f'"{every}"' in spec.read_text()
    return spec


def test_a_state_write_whose_reply_is_lost_does_not_strand_the_job(cluster, etcd):
    """The controller's writes of the job's moves to STARTING and to RUNNING each commit
    in etcd, but their replies are lost (the job would otherwise stay STARTING on a
    placement nobody was asked to prepare, or RUNNING with nothing started). The
    controller rebuilds the job from etcd and tells the agents again until they run
    what etcd says, and the job completes without a restart."""
    cluster.controller(
        launcher=[str(SCRIPTS / "lost_reply_controller.py")],
        env={"LOSE_REPLY_TO": "STARTING,RUNNING"},
    )
    for node in ("node-a", "node-b"):
        cluster.agent(node, slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="two nodes registered")
    spec = cluster.path / "ambiguous.toml"
    checkpoints = cluster.path / "checkpoints"
    spec.write_text(LOST_REPLY_SPEC.format(checkpoints=checkpoints, python=sys.executable))
    submitted = keel(
        "submit",
        str(spec),
        "--etcd-endpoints",
        etcd.endpoint,
        "--token-file",
        str(cluster.path / "token"),
        timeout_s=120,
    )
    assert submitted.returncode == 0, submitted.stderr

    def ended():
        value = cluster.store.job_state("ambiguous").value
        return value if value and value.state.terminal else None

    final = wait_for(ended, 240, 0.2, what="the job to end")
    log = (cluster.path / "controller.log").read_text()
    for state in ("STARTING", "RUNNING"):
        assert f"lost the reply to the write of ambiguous {state}" in log
    assert log.count("job rebuilt from etcd") >= 2
    assert (final.state, final.generation, final.restarts) == ("SUCCEEDED", 1, 0), final
    assert audit_checkpoint(checkpoints / "step_00000030") == {
        "expected": 120,
        "consumed": 120,
        "duplicates": 0,
        "missing": 0,
    }


EXACT_60 = {"expected": 960, "consumed": 960, "duplicates": 0, "missing": 0}
SPARE_RUN = (
    "--nodes",
    "2",
    "--slots-per-node",
    "1",
    "--spares",
    "1",
    "--steps",
    "60",
    "--checkpoint-every",
    "5",
    "--no-preflight",
)


def test_a_node_cut_off_from_the_cluster_stops_its_own_ranks_before_it_is_replaced(no_leaks):
    """node-1 loses etcd and the controller (its TCP proxy drops everything) but runs on.
    Its agent stops its ranks once its lease has gone a TTL unrenewed, so they do not
    train on beside their replacement, and the spare takes over."""
    run = no_leaks / "run"
    summary = run_up(run, *SPARE_RUN, "--inject", "partition_node:node=1,step=15,for=25")
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert "injected: node-1 cut from etcd and the controllers" in summary["_stderr"]
    assert (summary["steps"], summary["generations"]) == (60, 2)
    assert summary["data"] == EXACT_60
    replaced = next(e for e in summary["events"] if e["kind"] == "replaced")
    assert replaced["node"] == "node-1" and "node-2" in replaced["reason"]
    entries = assert_nothing_superseded_ran_on(run)
    cut_off = [e for e in entries if e["node"] == "node-1"]
    fenced = next(i for i, e in enumerate(cut_off) if e["event"] == "stopping the ranks")
    assert "self-fenced: no lease renewal" in cut_off[fenced]["reason"]
    # It stopped them while still cut off: between losing the controller and reaching
    # one again (if the partition healed before the job ended).
    cut = next(i for i, e in enumerate(cut_off) if e["event"] == "controller stream ended")
    connects = [i for i, e in enumerate(cut_off) if e["event"] == "connected to controller"]
    assert cut < fenced and not [i for i in connects if cut < i < fenced], (cut, fenced, connects)


def test_a_frozen_node_that_wakes_cannot_commit_over_its_replacement(no_leaks):
    """node-0 (rank 0: the committing rank) and every process on it freeze for 15 s
    while a save may be in flight; the spare replaces it. When it wakes, its agent
    stops what it ran at once (its lease is long gone), and the checkpoint directory
    belongs to generation 2: nothing of generation 1 lands there."""
    run = no_leaks / "run"
    # Generation 2's steps from 50 on are slowed (a straggler only reported), so node-0
    # wakes while it runs.
    summary = run_up(
        run,
        *SPARE_RUN,
        "--straggler-policy",
        "alert",
        "--inject",
        "stall_node:node=0,step=15,for=15",
        "--inject",
        "slow:rank=1,step=50,factor=10",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert "injected: node-0 frozen at step" in summary["_stderr"]
    assert (summary["steps"], summary["generations"]) == (60, 2)
    assert summary["data"] == EXACT_60
    assert_nothing_superseded_ran_on(run)
    checkpoints = run / "checkpoints"
    assert fence.owner(str(checkpoints)) == 2
    for step in committed_steps(checkpoints):
        path = checkpoints / f"step_{step:08d}"
        verdict = verify.check_alone(str(path))
        assert verdict.kind is verify.VerdictKind.OK, (step, verdict)
        assert json.loads((path / "ledger.json").read_text())["step"] == step


def test_the_rank_of_a_stalled_agent_stops_itself(no_leaks):
    """The only node's agent alone is stopped for 24 s; its rank runs on, and at step
    17 stops making progress (a hang nobody can see: the agent that would is stopped).
    The rank stops itself once its agent has answered nothing for the collective
    timeout (16 s here), rather than stay unsupervised with its resources for as long
    as its agent is gone, and the job restarts on the node when its agent is back.

    The stall is fired by `keel up` once it sees step 15 (up to a second late: the
    agent's flush, then its poll), and the rank hangs two steps later: the hang floor
    (8 s) is what keeps the agent from seeing the hang before it is stopped. With a
    3 s floor the test failed once in CI with three generations; stopping `keel up`
    for 4 s at step 14 reproduces that (the agent judges the hang, then is stopped in
    the next generation), and with the 8 s floor the same 4 s leaves two."""
    run = no_leaks / "run"
    summary = run_up(
        run,
        "--nodes",
        "1",
        "--slots-per-node",
        "1",
        "--steps",
        "40",
        "--checkpoint-every",
        "5",
        "--no-preflight",
        "--hang-floor-s",
        "8",
        "--collective-timeout-s",
        "16",
        "--inject",
        "stall_agent:node=0,step=15,for=24",
        "--inject",
        "hang:rank=0,step=17",
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert "injected: node-0's agent" in summary["_stderr"]
    assert (summary["steps"], summary["generations"]) == (40, 2), summary["events"]
    assert summary["data"] == EXACT_40
    assert_nothing_superseded_ran_on(run)
    rank0 = (run / "nodes" / "node-0" / "keel-up" / "gen1" / "rank0.err").read_text()
    assert "the agent has answered nothing for" in rank0, rank0[-2000:]
    # The agent, stopped, never saw the hang: no hang event.
    assert "hang" not in {e["kind"] for e in summary["events"]}


def put_all(client, items: dict[str, str]) -> None:
    """Write ``items`` to etcd in transactions of 100 puts."""
    tx, pairs = client.transactions, list(items.items())
    for i in range(0, len(pairs), 100):
        client.transaction(
            compare=[], success=[tx.put(k, v) for k, v in pairs[i : i + 100]], failure=[]
        )


def test_a_leader_that_takes_over_between_a_drains_stop_and_its_placement_replaces_the_node(
    cluster, etcd
):
    """A drain stopped the job's generation (a checkpoint, then the stop) and the job
    waits PENDING for a free node when the leader dies. The stop keeps the operation in
    etcd until the placement, so the new leader knows which node the job moves off and
    says so in a "replaced" event (the cordons alone would not tell it: a keel-up
    handover inside a drain)."""
    standby, common = a_leader_a_standby_and_two_nodes(cluster, etcd)
    checkpoints = cluster.path / "checkpoints"
    spec = trainer_spec(cluster.path, "drained", 40, 1000, checkpoints)
    assert keel("submit", str(spec), *common).returncode == 0

    def job():
        return cluster.store.job_state("drained").value

    def state():
        return job() and job().state

    wait_for(lambda: state() == "RUNNING", 120, 0.2, what="the job running")
    # No free node: the drain checkpoints, stops the generation, and the job waits.
    drained = keel("drain", "node-a", *common)
    assert drained.returncode == 0, drained.stderr
    wait_for(
        lambda: state() == "PENDING",
        120,
        0.2,
        what="the drained generation stopped, the job waiting for a node",
    )
    assert job().planned_stop and job().restarts == 0
    cluster.controllers[0].kill()
    cluster.controllers[0].wait()
    wait_for(lambda: cluster.store.controller_address() == standby, 60, what="the standby to lead")
    cluster.agent("node-c", slots="1")
    wait_for(lambda: state() == "SUCCEEDED", 180, 0.5, what="the job to end")
    final = job()
    assert (final.generation, final.restarts) == (2, 0), final
    events = keel("events", "drained", "--json", *common)
    assert events.returncode == 0, events.stderr
    replaced = [e for e in map(json.loads, events.stdout.splitlines()) if e["kind"] == "replaced"]
    assert [(e["node"], e["reason"]) for e in replaced] == [
        ("node-a", "node-a replaced by node-c")
    ], replaced
    last = committed_steps(checkpoints)[-1]
    assert audit_checkpoint(checkpoints / f"step_{last:08d}") == {
        "expected": last * 4,
        "consumed": last * 4,
        "duplicates": 0,
        "missing": 0,
    }


def test_a_job_with_ten_thousand_events_and_checkpoint_records_still_fails_over(cluster, etcd):
    """An ended job carries 10,000 events of 1 KiB and 10,000 checkpoint records, 11 MB
    (what older versions could pile up), past gRPC's 4 MiB receive limit for one range
    call. A new leader reads them in pages, loads its jobs and trims what it loaded to
    the bounds; the job running beside it carries on."""
    from common import keys
    from common.records import CheckpointRecord, EventRecord
    from orchestrator.controller.job_health import MAX_EVENTS
    from orchestrator.policy.retention import RECORDS_KEPT
    from protos import keel_pb2

    standby, common = a_leader_a_standby_and_two_nodes(cluster, etcd)

    def state_of(job):
        value = cluster.store.job_state(job).value
        return value and value.state

    history = cluster.path / "history.toml"
    history.write_text('name = "history"\nworld_size = 1\ncommand = ["true"]\n')
    assert keel("submit", str(history), *common).returncode == 0
    wait_for(lambda: state_of("history") == "SUCCEEDED", 60, what="history to end")
    checkpoints = cluster.path / "checkpoints"
    put_all(
        cluster.store.client,
        {
            **{
                keys.event("history", seq): EventRecord(
                    event=keel_pb2.Event(
                        kind=keel_pb2.EVENT_KIND_ALERT, reason=f"event {seq} " + "x" * 1024, seq=seq
                    )
                ).to_json()
                for seq in range(100, 10_100)
            },
            **{
                keys.checkpoint("history", step): CheckpointRecord(
                    step=step,
                    path=str(checkpoints / f"step_{step:08d}"),
                    generation=1,
                    samples=step * 4,
                    recorded_at_unix=0.0,
                ).to_json()
                for step in range(1, 10_001)
            },
        },
    )

    running = trainer_spec(cluster.path, "running", 1_000_000, 1_000_000, checkpoints)
    assert keel("submit", str(running), *common).returncode == 0

    def stepping():
        status = json.loads(keel("jobs", "--json", *common).stdout)
        return next(
            (j for j in status if j["job"] == "running" and int(j.get("step", 0)) > 0), None
        )

    before = wait_for(stepping, 120, 0.5, what="the running job stepping")
    cluster.controllers[0].kill()
    cluster.controllers[0].wait()
    wait_for(lambda: cluster.store.controller_address() == standby, 60, what="the standby to lead")
    # The new leader serves both jobs; it kept the newest events, within the bounds,
    # and deleted the rest, and the records past what restores could use.
    events = keel("events", "history", "--json", *common)
    assert events.returncode == 0, events.stderr
    seqs = [int(json.loads(line)["seq"]) for line in events.stdout.splitlines()]
    assert 0 < len(seqs) <= MAX_EVENTS and seqs[-1] == 10_099
    wait_for(
        lambda: (
            len(list(cluster.store.client.get_prefix(keys.events("history"), keys_only=True)))
            == len(seqs)
        ),
        60,
        what="the dropped events deleted from etcd",
    )
    wait_for(
        lambda: len(cluster.store.checkpoints("history")) == RECORDS_KEPT,
        60,
        what="the records pruned",
    )
    # It trains on under the new leader, and ends as the operator says: a checkpoint
    # now, then CANCELLED, nothing restarted, every sample of its lineage once.
    wait_for(
        lambda: (found := stepping()) and int(found["step"]) > int(before["step"]),
        60,
        0.5,
        what="the running job stepping under the new leader",
    )
    stopped = keel("stop", "running", "--wait", "--timeout-s", "120", *common, timeout_s=180)
    assert stopped.returncode == 0, stopped.stderr
    final = cluster.store.job_state("running").value
    assert (final.state, final.generation, final.restarts) == ("CANCELLED", 1, 0)
    (last,) = committed_steps(checkpoints)
    expected = last * 4
    assert audit_checkpoint(checkpoints / f"step_{last:08d}") == {
        "expected": expected,
        "consumed": expected,
        "duplicates": 0,
        "missing": 0,
    }


def test_a_drain_the_stalled_controller_never_answers_ends_at_the_drain_timeout(cluster, etcd):
    """SIGTERM to an agent whose controller is frozen (SIGSTOP): its Leaving goes
    unanswered, so no checkpoint-and-move ever comes. The agent must not wait forever
    (a scheduler would SIGKILL it mid-checkpoint): after --drain-timeout-s it stops its
    ranks itself, with their grace, and exits cleanly."""
    controller_address = cluster.controller()
    agent = cluster.agent("node-a", slots="1", extra=("--drain-timeout-s", "2"))
    wait_for(lambda: "node-a" in cluster.store.nodes(), 30, what="the agent to register")
    ran = keel(
        "run",
        "--etcd-endpoints",
        etcd.endpoint,
        "--token-file",
        str(cluster.path / "token"),
        "--detach",
        "--rdzv-id",
        "sleeper",
        "--no-python",
        "sleep",
        "300",
        timeout_s=60,
    )
    assert ran.returncode == 0, ran.stderr
    log = cluster.path / "node-a.log"
    started = wait_for(
        lambda: re.search(r'"pid": (\d+), "event": "rank started"', log.read_text()),
        60,
        what="the rank to start",
    )
    rank_pid = int(started[1])
    controller = next(p for p in cluster.controllers if p.poll() is None)
    assert cluster.store.controller_address() == controller_address
    os.kill(controller.pid, signal.SIGSTOP)
    try:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
        assert agent.returncode == 0
        text = log.read_text()
        assert "draining the node before stopping" in text
        assert "drain timed out; stopping the ranks" in text
        with pytest.raises(ProcessLookupError):
            os.kill(rank_pid, 0)
    finally:
        os.kill(controller.pid, signal.SIGCONT)
