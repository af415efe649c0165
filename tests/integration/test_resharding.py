"""Checkpoints load under any layout at any world size 1–4, exactly: parameters and
AdamW state (exp_avg, exp_avg_sq, step) gathered to full tensors after loading are
bit-for-bit those the saving run held when it committed. And a job that crashes and
resumes under another layout consumes every sample exactly once, as the ledger in its
final checkpoint proves.

Sources are saved under the five world-4 layouts and on one rank; each launch
(``scripts/reshard_cases.py``) saves or loads several cases one after another."""

import json
from pathlib import Path

import pytest

from orchestrator.local.ledger_check import audit as summarize
from tests.conftest import (
    REPO,
    SCHEDULED_MODEL,
    committed_steps,
    crash_in_2d,
    step_losses,
    torchrun,
)
from trainer.checkpoint_dir import expired
from trainer.optim import lr_factor

SCRIPT = REPO / "tests" / "integration" / "scripts" / "reshard_cases.py"
# Two steps, so that the optimizer state is not the first step's; four layers, so that
# interleaved pipelines have four stages; short sequences to keep it quick.
COMMON = ["--steps", "2", "--checkpoint-every", "2", "--layers", "4", "--seq-len", "32"]

SOURCES = {
    "dp_shard=4": ["--layout", "dp_shard=4"],
    "dp_replicate=2,dp_shard=2": ["--layout", "dp_replicate=2,dp_shard=2"],
    "dp_shard=2,tp=2": ["--layout", "dp_shard=2,tp=2"],
    "tp=2,pp=2": ["--layout", "tp=2,pp=2", "--pp-schedule", "interleaved_1f1b"],
    "dp_shard=2,pp=2": ["--layout", "dp_shard=2,pp=2"],
}
# Target layouts by world size; the one-rank source is saved with no flags.
TARGETS = {
    4: {
        "dp_shard=4": ["tp=2,pp=2"],
        "dp_replicate=2,dp_shard=2": ["dp_shard=2,tp=2"],
        "dp_shard=2,tp=2": ["dp_shard=2,pp=2 interleaved", "tp=4"],
        "tp=2,pp=2": ["dp_replicate=2,dp_shard=2", "pp=4"],
        "dp_shard=2,pp=2": ["dp_shard=2,tp=2"],
        "one rank": ["dp_shard=2,pp=2"],
    },
    2: {
        "tp=2,pp=2": ["dp_shard=2"],
        "dp_shard=2,tp=2": ["pp=2 interleaved"],
        "dp_replicate=2,dp_shard=2": ["tp=2"],
        "one rank": ["dp_replicate=2"],
    },
    1: {source: ["dp_shard=1"] for source in SOURCES},
}

pytestmark = pytest.mark.timeout(300)


def target_flags(target: str) -> list[str]:
    layout, _, schedule = target.partition(" ")
    return ["--layout", layout] + (
        ["--pp-schedule", "interleaved_1f1b"] if schedule == "interleaved" else []
    )


def source_dir(name: str) -> str:
    return name.replace("=", "").replace(",", "_").replace(" ", "_")


# --- pure: retention -------------------------------------------------------------------


def test_retention_keeps_the_newest_and_the_protected():
    assert expired([5, 10, 15, 20], keep=2, protected=set()) == [5, 10]
    assert expired([5, 10, 15, 20], keep=2, protected={5}) == [10]
    assert expired([5, 10, 15, 20], keep=0, protected=set()) == []
    assert expired([20], keep=1, protected={20}) == []
    # Newer checkpoints of a dead lineage do not push out the one just committed.
    assert expired([10, 12, 15, 16], keep=2, protected={10, 12}) == []


def test_the_lr_schedule_warms_up_then_decays_to_its_floor():
    # Part of the trainer state a checkpoint carries (as the scheduler's position).
    factors = [
        lr_factor(step, warmup_steps=4, total_steps=10, schedule="cosine") for step in range(11)
    ]
    assert factors[:4] == [0.2, 0.4, 0.6, 0.8]
    assert factors[4] == 1.0 and factors[10] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(factors[4:], factors[5:]))
    assert lr_factor(7, warmup_steps=0, total_steps=10, schedule="constant") == 1.0


# --- real ranks ----------------------------------------------------------------------


def run_cases(nproc: int, root: Path, cases: list[dict]) -> list[dict]:
    run = torchrun(nproc, str(SCRIPT), str(root), json.dumps(cases), "--", *COMMON)
    assert run.returncode == 0, (
        f"launch failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    )
    return [
        json.loads(line.removeprefix("RESULT "))
        for line in run.stdout.splitlines()
        if line.startswith("RESULT ")
    ]


@pytest.mark.integration
def test_checkpoints_load_bit_for_bit_under_any_layout_and_world_size(tmp_path):
    loads = {}
    # One rank first: its checkpoint is a source for the world-4 and world-2 launches.
    run_cases(1, tmp_path, [{"save": source_dir("one rank"), "flags": []}])
    cases = [{"save": source_dir(name), "flags": flags} for name, flags in SOURCES.items()]
    for world_size in (4, 2, 1):
        cases += [
            {"load": source_dir(source), "flags": target_flags(target)}
            for source, targets in TARGETS[world_size].items()
            for target in targets
        ]
        for result in run_cases(world_size, tmp_path, cases):
            loads[(result["source"], world_size, result["target"])] = result
        cases = []

    expected_cases = sum(
        len(targets) for targets in TARGETS.values() for targets in targets.values()
    )
    assert len(loads) == expected_cases
    for case, result in sorted(loads.items()):
        # 39 parameters: each with its weights, exp_avg, exp_avg_sq, step and param-group values.
        assert result["saved"] == result["compared"] > 4 * 39, case
        assert result["exp_avg_tensors"] == 39, case
        assert result["uncovered"] == [], case
        assert result["differing"] == [], case
        assert result["optimizer_steps"] == [2.0], case
    print(f"{len(loads)} resharding cases bit-for-bit equal:", sorted(loads))


@pytest.mark.integration
def test_a_crash_and_a_resume_under_another_layout_consume_every_sample_exactly_once(tmp_path):
    ckpt = tmp_path / "ckpt"
    # A schedule whose learning rate changes every step, so that resuming it at the
    # wrong position would show in the losses.
    flags = [
        "-m",
        "trainer.train",
        "--steps",
        "10",
        "--checkpoint-every",
        "3",
        "--keep-checkpoints",
        "2",
        *SCHEDULED_MODEL,
    ]
    reference, crashed = crash_in_2d(flags, ckpt)
    assert 8 in step_losses(crashed, check=False)
    # Async saves commit when their write is done; step 6's had two steps to finish.
    committed = committed_steps(ckpt)
    assert committed and committed[-1] in (3, 6), committed
    restored = committed[-1]

    # Plain torchrun on two ranks as a two-stage interleaved pipeline, from the latest.
    resumed = torchrun(
        2,
        *flags,
        "--layout",
        "pp=2",
        "--pp-schedule",
        "interleaved_1f1b",
        env={"KEEL_CHECKPOINT_DIR": str(ckpt)},
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {ckpt / f'step_{restored:08d}'} at step={restored}" in resumed.stderr
    print(f"crashed at step 9 with steps {committed} committed; resumed from step {restored}")
    assert committed_steps(ckpt) == sorted({restored, 9, 10})

    ledger = json.loads((ckpt / "step_00000010" / "ledger.json").read_text())
    assert (ledger["global_batch"], ledger["step"]) == (16, 10)
    # The failed generation trained steps up to 8 after its last commit; only the
    # resumed generation's runs of those steps are in the lineage.
    assert [entry[0] for entry in ledger["ranges"]] == list(range(1, 11))
    assert summarize(ledger["ranges"], 10 * 16) == {
        "expected": 160,
        "consumed": 160,
        "duplicates": 0,
        "missing": 0,
    }
    # Every committed checkpoint's ledger is its own prefix of the lineage.
    earlier = json.loads((ckpt / "step_00000009" / "ledger.json").read_text())
    assert earlier["ranges"] == ledger["ranges"][:9]
    # Weights, optimizer, schedule and data position all resumed exactly: the losses
    # are those of an uninterrupted single-rank run (to the few-ulp drift of other
    # reduction orders; see test_layouts).
    crashed_losses, resumed_losses = step_losses(crashed, check=False), step_losses(resumed)
    assert sorted(resumed_losses) == list(range(restored + 1, 11))
    for step, loss in {**crashed_losses, **resumed_losses}.items():
        assert abs(loss - reference[step]) <= 1e-5 * loss + 1e-6, (step, loss, reference[step])
