"""Composite-parallel layouts: which ones the trainer accepts (pure checks, first), and
that every layout at world size 4 computes what one process computes (real gloo ranks).

The numerics test runs the same model, seed and global batch for 5 steps under
dp_shard=4, dp_replicate=2,dp_shard=2 (HSDP), dp_shard=2,tp=2, tp=2,pp=2 and
dp_shard=2,pp=2, with gradient accumulation, activation checkpointing and every
pipeline schedule spread over them, and compares each step's loss and global gradient
norm with a single-process run. The five layouts share one torchrun launch
(``scripts/layout_losses.py``); one more launch checks the real ``python -m
trainer.train`` entry point with its ``--layout`` flag overriding ``KEEL_MESH``."""

import json
import re
import subprocess

import pytest

from tests.conftest import REPO, step_losses, torchrun
from trainer import pipeline
from trainer.mesh import BatchPlan, Layout, validate
from trainer.model import ModelConfig

LAYOUT_SCRIPT = REPO / "tests" / "integration" / "scripts" / "layout_losses.py"
GLOBAL_BATCH = 16
# Every run clips, so that each reports the global gradient norm it measured; 1.0 is
# crossed at step 3 only, so the runs clip at some steps and not at others.
COMMON = [
    "--steps",
    "5",
    "--layers",
    "4",
    "--global-batch",
    str(GLOBAL_BATCH),
    "--clip-grad",
    "1.0",
]
# fp32 on CPU. The layouts add the same numbers in other orders (reduce-scatter over
# ranks, micro-batch and accumulation sums, sequence-parallel gathers), which moves
# results by a few ulps (~1e-7 relative) per reduction; over 5 AdamW steps we see at
# most ~5e-7 relative. 1e-5 leaves room for other CPUs and BLAS builds and still fails
# for any real error: a wrong scale of the gradient shows in its norm at once, and
# wrong samples, a wrong stage split or a dropped tensor-parallel reduction move the
# loss by 1e-3 or more.
RTOL = 1e-5

LAYOUTS = {
    "dp_shard=4": ["--layout", "dp_shard=4"],
    "dp_replicate=2,dp_shard=2": ["--layout", "dp_replicate=2,dp_shard=2", "--grad-accum", "2"],
    "dp_shard=2,tp=2": ["--layout", "dp_shard=2,tp=2", "--activation-checkpointing"],
    "tp=2,pp=2": [
        "--layout",
        "tp=2,pp=2",
        "--pp-schedule",
        "interleaved_1f1b",
        "--activation-checkpointing",
    ],
    "dp_shard=2,pp=2": [
        "--layout",
        "dp_shard=2,pp=2",
        "--pp-schedule",
        "gpipe",
        "--microbatches",
        "4",
        "--grad-accum",
        "2",
    ],
}

pytestmark = pytest.mark.timeout(240)

CONFIG = ModelConfig(vocab=256, dim=64, layers=4, heads=4, max_seq_len=64)


def plan(
    layout: Layout,
    global_batch: int = 16,
    grad_accum: int = 1,
    microbatches: int | None = None,
    pp_schedule: str = "1f1b",
    virtual_stages: int = 2,
) -> BatchPlan:
    return BatchPlan.for_layout(
        layout,
        global_batch=global_batch,
        grad_accum=grad_accum,
        microbatches=microbatches,
        pp_schedule=pp_schedule,
        virtual_stages=virtual_stages,
    )


# --- pure: deciding whether a layout fits ---------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        Layout(dp_shard=4),
        Layout(dp_replicate=2, dp_shard=2),
        Layout(dp_shard=2, tp=2),
        Layout(tp=2, pp=2),
        Layout(dp_shard=2, pp=2),
        Layout(tp=4),
        Layout(pp=4),
    ],
)
def test_the_tested_layouts_are_valid(layout):
    validate(layout, CONFIG, plan(layout), 4)


@pytest.mark.parametrize(
    "layout, batch_plan, config, message",
    [
        (
            Layout(dp_shard=2),
            None,
            CONFIG,
            "spans 2 ranks but the world size is 4; make dp_replicate × dp_shard × tp × pp equal 4",
        ),
        (
            Layout(dp_shard=1, tp=4),
            None,
            ModelConfig(heads=6, dim=48, layers=4),
            "6 attention heads do not split over tp=4; choose tp dividing 6",
        ),
        (
            Layout(pp=4),
            None,
            ModelConfig(layers=2),
            "make 4 pipeline stages but the model has 2 layers; use at most 2",
        ),
        (
            Layout(dp_shard=2, pp=2),
            {"pp_schedule": "interleaved_1f1b", "virtual_stages": 4},
            CONFIG,
            "pp=2 × 4 stages per rank make 8 pipeline stages",
        ),
        (
            Layout(dp_shard=2, pp=2),
            {"microbatches": 1},
            CONFIG,
            "1f1b needs at least one micro-batch per pipeline rank: --microbatches 1 < pp=2; "
            "use --microbatches 2",
        ),
        (
            Layout(dp_shard=2, pp=2),
            {"pp_schedule": "interleaved_1f1b", "microbatches": 3},
            CONFIG,
            "--microbatches 3 is not a multiple of 2",
        ),
        (
            Layout(dp_shard=4),
            {"grad_accum": 8},
            CONFIG,
            "global batch 16 does not split into 4 data-parallel ranks "
            "× 8 accumulation steps = 32; use a multiple of 32",
        ),
        (
            Layout(dp_shard=2, pp=2),
            {"microbatches": 16},
            CONFIG,
            "× 16 micro-batches = 32; use a multiple of 32",
        ),
        (
            Layout(dp_shard=2, tp=2),
            None,
            ModelConfig(layers=4, max_seq_len=63),
            "use a sequence length that is a multiple of 2",
        ),
    ],
)
def test_misfits_are_refused_with_a_fix(layout, batch_plan, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(layout, config, plan(layout, **(batch_plan or {})), 4)


def test_pipeline_settings_apply_only_with_pipeline_parallelism():
    # The same command line must run under any layout the controller picks.
    flat = plan(Layout(dp_shard=4), microbatches=3, pp_schedule="interleaved_1f1b")
    assert (flat.microbatches, flat.virtual_stages) == (1, 1)
    validate(Layout(dp_shard=4), CONFIG, flat, 4)
    assert plan(Layout(dp_shard=2, pp=2)).microbatches == 2  # default: one per pipeline rank
    assert plan(Layout(pp=2), pp_schedule="1f1b", virtual_stages=2).virtual_stages == 1


def test_ranks_are_laid_out_pp_outermost_and_tp_innermost():
    layout = Layout(dp_replicate=1, dp_shard=2, tp=2, pp=2)
    assert [layout.coordinates(rank)["tp"] for rank in range(8)] == [0, 1] * 4
    assert [layout.coordinates(rank)["pp"] for rank in range(8)] == [0] * 4 + [1] * 4
    # tp and pp peers read the same samples; dp ranks differ.
    assert [layout.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.speaks_for_its_data(rank) for rank in range(8)] == [True, False, True, False] + [
        False
    ] * 4
    hsdp = Layout(dp_replicate=2, dp_shard=2)
    assert [hsdp.dp_rank(rank) for rank in range(4)] == [0, 1, 2, 3]


def test_layout_flag_errors_name_the_flag():
    with pytest.raises(
        ValueError, match=re.escape("--layout='dp_shard=4' spans 4 ranks but WORLD_SIZE=2")
    ):
        Layout.parse("dp_shard=4", 2, source="--layout")
    assert Layout.parse("tp=2,pp=2", 4) == Layout(tp=2, pp=2)
    assert Layout.parse("", 4) == Layout(dp_shard=4)


@pytest.mark.parametrize(
    "layers, stages, expected",
    [
        (2, 2, [[0], [1]]),
        (4, 4, [[0], [1], [2], [3]]),
        (4, 2, [[0, 1], [2, 3]]),
        # The embedding and the head weigh one block each: middle stages take more blocks.
        (6, 4, [[0], [1, 2], [3, 4], [5]]),
        (5, 2, [[0, 1, 2], [3, 4]]),
    ],
)
def test_stages_split_blocks_counting_embedding_and_head(layers, stages, expected):
    assert [list(owned) for owned in pipeline.stage_layers(layers, stages)] == expected


def test_interleaved_stages_loop_over_the_pipeline_ranks():
    assert pipeline.local_stage_indices(0, pp=2, virtual_stages=2) == [0, 2]
    assert pipeline.local_stage_indices(1, pp=2, virtual_stages=2) == [1, 3]


# --- real ranks: every layout computes what one process computes ----------------------


def results(run: subprocess.CompletedProcess) -> dict[str, dict[int, dict]]:
    assert run.returncode == 0, (
        f"launch failed ({run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    )
    found: dict[str, dict[int, dict]] = {}
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            found.setdefault(result["case"], {})[result["step"]] = result
    return found


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def single_process():
    """The reference: one rank, everything in one process."""
    run = torchrun(
        1, str(LAYOUT_SCRIPT), json.dumps([{"name": "single", "flags": []}]), "--", *COMMON
    )
    return results(run)["single"]


@pytest.mark.integration
def test_every_layout_matches_a_single_process(single_process):
    cases = [{"name": name, "flags": flags} for name, flags in LAYOUTS.items()]
    found = results(torchrun(4, str(LAYOUT_SCRIPT), json.dumps(cases), "--", *COMMON))
    assert sorted(found) == sorted(LAYOUTS)
    worst = {}
    for name, steps in found.items():
        assert sorted(steps) == [1, 2, 3, 4, 5], name
        for step, result in steps.items():
            reference = single_process[step]
            assert relative(result["loss"], reference["loss"]) <= RTOL, (
                name,
                step,
                result,
                reference,
            )
            assert relative(result["grad_norm"], reference["grad_norm"]) <= RTOL, (
                name,
                step,
                result,
                reference,
            )
            # The data-parallel ranks together read the global batch, each sample once.
            first = (step - 1) * GLOBAL_BATCH
            covered = sorted(
                index
                for start, count in result["consumed"]
                for index in range(start, start + count)
            )
            assert covered == list(range(first, first + GLOBAL_BATCH)), (
                name,
                step,
                result["consumed"],
            )
        worst[name] = tuple(
            max(relative(steps[s][key], single_process[s][key]) for s in steps)
            for key in ("loss", "grad_norm")
        )
    print("worst relative (loss, grad norm) difference per layout:", worst)
    assert single_process[5]["loss"] < single_process[1]["loss"] - 0.5, (
        "the reference did not learn"
    )
    # Clipping was active at some steps and not at others (see COMMON).
    norms = [single_process[step]["grad_norm"] for step in range(1, 6)]
    assert min(norms) < 1.0 < max(norms), norms


@pytest.mark.integration
def test_the_layout_flag_overrides_keel_mesh_in_the_real_entry_point(single_process):
    run = torchrun(
        4,
        "-m",
        "trainer.train",
        *COMMON,
        "--layout",
        "dp_shard=2,pp=2",
        "--pp-schedule",
        "1f1b",
        env={"KEEL_MESH": "dp_shard=4"},
    )
    losses = step_losses(run, only_steps=True)
    assert "fresh start on 4 ranks as dp_shard=2,pp=2" in run.stderr
    assert sorted(losses) == [1, 2, 3, 4, 5]
    for step, loss in losses.items():
        assert abs(loss - single_process[step]["loss"]) <= RTOL * loss + 1e-6, (
            step,
            loss,
            single_process[step],
        )


@pytest.mark.integration
def test_a_layout_that_does_not_fit_fails_before_training_with_the_fix():
    run = torchrun(2, "-m", "trainer.train", "--steps", "1", "--layout", "pp=2", "--layers", "1")
    assert run.returncode != 0
    assert (
        "ValueError: pp=2 × 1 stages per rank make 2 pipeline stages but the model has 1 layers"
        in run.stderr
    )
    assert step_losses(run, check=False) == {}
