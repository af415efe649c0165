"""The reference trainer under real torchrun on gloo: it learns, commits checkpoints
durably (asynchronously, with a ledger and retention), resumes on another world size
where it left off, reports to the agent's AgentLocal service on a Unix socket, and turns
an injected crash into torchrun's root cause.

Each launch costs a few seconds of interpreter and torch start-up on two cores, so the
runs are few and shared between assertions."""

import json
import math

import pytest
from google.protobuf import json_format

from protos import keel_pb2
from tests.conftest import committed_steps, step_losses, torchrun

GLOBAL_BATCH, SEQ_LEN = 16, 64

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_two_ranks_learn_commit_and_resume_on_one_rank(tmp_path, agent):
    socket_path, recorder = agent
    ckpt = tmp_path / "ckpt"

    # Two ranks, as Keel would start them: checkpoint dir and identity from KEEL_*.
    first = torchrun(
        2,
        "-m",
        "trainer.train",
        "--steps",
        "12",
        "--checkpoint-every",
        "5",
        env={
            "KEEL_CHECKPOINT_DIR": str(ckpt),
            "KEEL_AGENT_SOCKET": socket_path,
            "KEEL_JOB": "demo",
            "KEEL_GENERATION": "3",
            "KEEL_MESH": "dp_shard=2",
            "KEEL_RANK_TOKEN": recorder.token_for(3, 2, ckpt),
        },
    )
    losses = step_losses(first, only_steps=True)
    assert sorted(losses) == list(range(1, 13))
    assert abs(losses[1] - math.log(256)) < 0.3, "an untrained model should be near ln(vocab)"
    assert losses[12] < losses[1] - 1.0, f"loss did not fall: {losses}"

    assert committed_steps(ckpt) == [5, 10, 12]
    assert all((ckpt / f"step_{step:08d}" / ".metadata").is_file() for step in (5, 10, 12))
    assert not [path.name for path in ckpt.iterdir() if path.name.endswith(".tmp")]
    # Every committed checkpoint carries the lineage's ledger up to its step.
    ledger = json.loads((ckpt / "step_00000010" / "ledger.json").read_text())
    assert ledger == {
        "global_batch": GLOBAL_BATCH,
        "step": 10,
        "ranges": [[step, (step - 1) * GLOBAL_BATCH, GLOBAL_BATCH] for step in range(1, 11)],
    }

    reported = {
        (report.rank, report.step): (generation, report) for generation, report in recorder.steps()
    }
    checkpoints = recorder.of("checkpoint")
    assert set(reported) == {(rank, step) for rank in (0, 1) for step in range(1, 13)}
    for (_rank, step), (generation, report) in reported.items():
        assert generation == 3
        assert report.tokens == GLOBAL_BATCH // 2 * SEQ_LEN
        assert report.loss == pytest.approx(losses[step], abs=1e-6)
        assert report.step_time_s > 0 and report.at > 0
    assert [(c.job, c.generation, c.step, c.path, c.samples) for c in checkpoints] == [
        ("demo", 3, step, str(ckpt / f"step_{step:08d}"), step * GLOBAL_BATCH)
        for step in (5, 10, 12)
    ]

    # Plain torchrun on one rank: it finds the latest committed checkpoint itself and
    # DCP reshards the two ranks' shards onto one. Retention keeps the newest four.
    resumed = torchrun(
        1,
        "-m",
        "trainer.train",
        "--steps",
        "16",
        "--checkpoint-every",
        "5",
        "--checkpoint-dir",
        str(ckpt),
        "--keep-checkpoints",
        "4",
    )
    resumed_losses = step_losses(resumed, only_steps=True)
    assert sorted(resumed_losses) == [13, 14, 15, 16], resumed.stdout
    assert (
        f"resumed from {ckpt / 'step_00000012'} at step=12 samples=192 on 1 ranks" in resumed.stderr
    )
    assert resumed_losses[13] < losses[1] - 1.0, "the resumed model forgot what it learnt"
    assert committed_steps(ckpt) == [10, 12, 15, 16]
    assert "retention (--keep-checkpoints 4) deleted checkpoints of steps 5" in resumed.stderr

    # Keel names an earlier checkpoint (step 12 was never recorded as committed): the
    # run continues from step 10, replaces step_00000012, and - same global batch,
    # same samples - repeats the two-rank run's losses on one rank. Retention (keep 3)
    # spares step 10, which it restored from, and step 12, which it just committed.
    replayed = torchrun(
        1,
        "-m",
        "trainer.train",
        "--steps",
        "12",
        "--checkpoint-every",
        "6",
        "--no-async-checkpoint",
        env={
            "KEEL_CHECKPOINT_DIR": str(ckpt),
            "KEEL_RESTORE_FROM": str(ckpt / "step_00000010"),
            "KEEL_GENERATION": "4",
        },
    )
    replayed_losses = step_losses(replayed, only_steps=True)
    assert sorted(replayed_losses) == [11, 12]
    for step in (11, 12):
        assert replayed_losses[step] == pytest.approx(losses[step], abs=1e-4)
    assert f"replacing unrecorded checkpoint {ckpt / 'step_00000012'}" in replayed.stderr
    assert sorted(path.name for path in (ckpt / "step_00000012").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "ledger.json",
        "manifest.json",
    ]
    assert committed_steps(ckpt) == [10, 12, 15, 16]
    assert not [path.name for path in ckpt.iterdir() if path.name.endswith(".tmp")]


def test_first_step_loss_is_the_same_on_one_and_two_ranks():
    one = step_losses(torchrun(1, "-m", "trainer.train", "--steps", "1"), only_steps=True)
    two = step_losses(torchrun(2, "-m", "trainer.train", "--steps", "1"), only_steps=True)
    assert one[1] == pytest.approx(two[1], abs=1e-5)


def test_injected_crash_is_torchruns_root_cause_and_leaves_its_marker(tmp_path):
    faults = json_format.MessageToJson(
        keel_pb2.FaultSchedule(
            faults=[keel_pb2.Fault(kind=keel_pb2.FAULT_KIND_CRASH, rank=1, step=2)]
        )
    )
    run = torchrun(
        2,
        "-m",
        "trainer.train",
        "--steps",
        "3",
        env={"KEEL_CHECKPOINT_DIR": str(tmp_path), "KEEL_FAULTS": faults},
    )
    assert run.returncode != 0
    assert sorted(step_losses(run, check=False)) == [1]
    # torchrun copies the traceback from the rank's TORCHELASTIC_ERROR_FILE (@record).
    root_cause = run.stderr.split("Root Cause")[-1]
    assert "rank      : 1" in root_cause
    assert "RuntimeError: injected crash at step 2 on rank 1" in root_cause
    assert (tmp_path / ".faults" / "0").is_file()
