"""The trainer's health signals under real torchrun on gloo, heard by the agent's real
AgentLocal service on a Unix socket: step phases, a flagged report before every save,
a checkpoint the agent asks for taken at the same step on every rank, preflight
figures; and, with two bare gloo processes, that a late rank is named by the start
barrier and that the shortened collective timeout applies."""

import os
import subprocess
import sys

import pytest

from common.wire_kinds import WIRE_COLLECTIVES
from tests.conftest import REPO, committed_steps, step_losses, torchrun
from trainer import preflight
from trainer.preflight import bus_bandwidth

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS, EVERY = 40, 35
# The agent asks for a checkpoint, once, in the ack of the first call that reports
# this step or a later one.
ASK_AFTER_STEP = 3
PREFLIGHT_SIZES = (0.25 * (1 << 20), 1 << 20)


@pytest.mark.parametrize("agent", [{"ask_from_step": ASK_AFTER_STEP}], indirect=True, ids=["asks"])
def test_phases_flagged_saves_requested_checkpoint_and_preflight(tmp_path, agent):
    socket_path, recorder = agent
    ckpt = tmp_path / "ckpt"
    run = torchrun(
        2,
        "-m",
        "trainer.train",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--keep-checkpoints",
        "0",
        "--preflight-sizes-mb",
        "0.25,1",
        env={
            "KEEL_CHECKPOINT_DIR": str(ckpt),
            "KEEL_AGENT_SOCKET": socket_path,
            "KEEL_JOB": "demo",
            "KEEL_GENERATION": "2",
            "KEEL_RANK_TOKEN": recorder.token_for(2, 2, ckpt),
        },
    )
    assert sorted(step_losses(run, only_steps=True)) == list(range(1, STEPS + 1))

    # The requested checkpoint: one extra committed step, off the schedule, after the
    # agent asked; both ranks wrote their shard of it, so both saved at that step.
    saved = committed_steps(ckpt)
    (requested,) = [step for step in saved if step not in (EVERY, STEPS)]
    assert saved == [requested, EVERY, STEPS] and ASK_AFTER_STEP < requested < EVERY
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {
        p.name for p in (ckpt / f"step_{requested:08d}").iterdir()
    }
    assert f"the agent asked for a checkpoint: saving after step {requested}" in run.stderr

    steps = {(report.rank, report.step): report for report in recorder.of("step")}
    assert set(steps) == {(rank, step) for rank in (0, 1) for step in range(1, STEPS + 1)}
    for report in steps.values():
        assert report.data_s > 0 and report.compute_s > 0 and report.optimizer_s > 0
        # The phases are parts of the rank's own step time.
        assert report.data_s + report.compute_s + report.optimizer_s <= report.step_time_s + 1e-3
        # Every save, and only a save, is announced by the report of its step.
        assert report.checkpointing == (report.step in saved)
        # Nothing to block on before the first save.
        if report.step <= requested:
            assert report.checkpoint_s == 0
    # A save's blocking time (staging, and rank 0's commit when the write is done)
    # comes with the next steps' reports.
    for step in saved[:-1]:
        assert steps[0, step + 1].checkpoint_s > 0 and steps[1, step + 1].checkpoint_s > 0

    # Each rank's flagged report reached the agent before rank 0 committed the save.
    events = [
        (kind, payload.step) for kind, payload in recorder.events if kind in ("step", "checkpoint")
    ]
    assert [step for kind, step in events if kind == "checkpoint"] == saved
    for step in saved:
        committed_at = events.index(("checkpoint", step))
        assert sum(1 for kind, at in events[:committed_at] if kind == "step" and at == step) == 2

    preflights = recorder.of("preflight")
    assert sorted(report.rank for report in preflights) == [0, 1]
    for report in preflights:
        assert (report.job, report.generation, report.world_size) == ("demo", 2, 2)
        assert report.wall_s > 0
        measured = sorted((r.collective, r.size_bytes) for r in report.results)
        assert measured == sorted(
            (WIRE_COLLECTIVES.to_wire(c), int(size))
            for c in preflight.COLLECTIVES
            for size in PREFLIGHT_SIZES
        )
        for result in report.results:
            assert result.time_s > 0
            collective = WIRE_COLLECTIVES.from_wire(result.collective)
            algbw, busbw = bus_bandwidth(collective, result.size_bytes, result.time_s, 2)
            assert result.algbw_gbps == pytest.approx(
                result.size_bytes / result.time_s / 1e9, rel=1e-12
            )
            assert (result.algbw_gbps, result.busbw_gbps) == pytest.approx(
                (algbw, busbw), rel=1e-12
            )
    assert run.stderr.count("preflight over 2 ranks in") == 1


# Two bare gloo ranks (a FileStore rendezvous: no port to pick). "late": rank 1 stays
# away from the start barrier; "timeout": rank 1 stays away from an all_reduce after
# the collective timeout was shortened to 1.5 s, against a start-up timeout of 60 s.
RANKS_SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from trainer import watchdog
mode, store, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group(
    "gloo", init_method="file://" + store, rank=rank, world_size=2, timeout=timedelta(seconds=60)
)
if mode == "timeout":
    watchdog.set_collective_timeout(1.5, [])
if rank == 1:
    time.sleep(5)
    os._exit(0)
started = time.monotonic()
try:
    if mode == "late":
        watchdog.start_barrier(1.5)
    else:
        dist.all_reduce(torch.ones(1))
except RuntimeError as error:
    print(f"{type(error).__name__} after {time.monotonic() - started:.1f} s: {error}", flush=True)
    os._exit(3)
os._exit(0)
"""


def test_late_rank_is_named_and_the_short_collective_timeout_applies(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launched: dict[str, list[subprocess.Popen]] = {}
    try:
        for mode in ("late", "timeout"):
            launched[mode] = []
            for rank in (0, 1):
                launched[mode].append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            RANKS_SCRIPT,
                            mode,
                            str(tmp_path / f"{mode}.store"),
                            str(rank),
                        ],
                        cwd=REPO,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=env,
                    )
                )
        outputs = {
            mode: [process.communicate(timeout=90) for process in processes]
            for mode, processes in launched.items()
        }
    finally:
        for processes in launched.values():
            for process in processes:
                process.kill()
                process.wait()
                process.stdout.close()
                process.stderr.close()
    for mode, processes in launched.items():
        assert [process.returncode for process in processes] == [3, 0], outputs[mode]

    late = outputs["late"][0][0]
    assert late.startswith("StartBarrierError after "), late
    assert (
        "generation start: rank 1 did not reach the start barrier within 1.5 s (1/2 ranks arrived)"
    ) in late
    timeout = outputs["timeout"][0][0]
    # Failed on the 1.5 s it was given (1500ms in gloo's message), not the 60 s the
    # group started with.
    assert "1500ms" in timeout, timeout
    assert float(timeout.split(" after ")[1].split(" s")[0]) < 60, timeout


FENCED_RANK = """
import sys, time
from trainer import runtime
rt = runtime.init()
step = 0
while True:   # trains fast, as a real rank would, until something stops it
    step += 1
    rt.report_step(step, loss=1.0, tokens=64, step_time_s=0.001)
    time.sleep(0.001)
"""


def test_a_rank_whose_agent_stops_answering_stops_itself():
    """The agent's socket accepts calls but never answers (a SIGSTOPped agent looks like
    this). The rank stops itself after the collective timeout: its reporter, though
    busy timing out one batch after another, counts how long the agent has been
    silent."""
    from tests.conftest import local_agent
    from tests.unit.trainer.test_runtime import StuckAgent

    stuck = StuckAgent()
    with local_agent(stuck) as socket_path:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "KEEL_JOB": "j",
            "KEEL_GENERATION": "1",
            "KEEL_AGENT_SOCKET": socket_path,
            "KEEL_RANK_TOKEN": stuck.token_for(1, 1),
            "KEEL_COLLECTIVE_TIMEOUT_S": "4",
        }
        try:
            rank = subprocess.run(
                [sys.executable, "-c", FENCED_RANK],
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            stuck.release.set()
    assert rank.returncode == -15, rank.stderr[-2000:]
    assert "the agent has answered nothing for" in rank.stderr
    assert "(the collective timeout is 4 s): stopping this rank" in rank.stderr
