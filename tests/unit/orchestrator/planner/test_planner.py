"""The layout planner against the textbook figures, and its errors' wording."""

import json

import pytest

from orchestrator.planner import (
    GB,
    Cluster,
    Layout,
    LayoutError,
    ModelShape,
    NoFit,
    Training,
    activation_bytes_per_layer,
    best,
    candidates,
    pipeline_bubble,
    table,
    to_json,
    validate_layout,
    zero_memory_per_gpu_bytes,
)

# Llama-2-70B-like width with full multi-head attention; params pinned to 70e9.
LLAMA_70B = ModelShape(params=70e9, layers=80, hidden=8192, heads=64, vocab=32000)
H100_x64 = Cluster(world_size=64, gpus_per_node=8, gpu_memory_gb=80)


def test_zero_stages_for_70b_on_64_gpus_match_the_textbook_table():
    gb = {stage: zero_memory_per_gpu_bytes(70e9, 64, stage) / GB for stage in range(4)}
    assert gb[0] == pytest.approx(1120)  # 16Ψ
    assert gb[1] == pytest.approx(4 * 70 + 12 * 70 / 64)  # 293.1
    assert round(gb[1], 1) == 293.1
    assert gb[2] == pytest.approx(2 * 70 + 14 * 70 / 64)  # 155.3
    assert round(gb[2], 1) == 155.3
    assert gb[3] == pytest.approx(17.5)  # 16Ψ/64


def test_a_7b_model_state_is_112_gb_and_fp32_splits_the_same_16_bytes_differently():
    assert zero_memory_per_gpu_bytes(7e9, 1, 0) == pytest.approx(112e9)
    assert zero_memory_per_gpu_bytes(7e9, 1, 0, precision="fp32") == pytest.approx(112e9)
    # ZeRO-1 keeps weights + grads whole: 2 + 2 in bf16, 4 + 4 in fp32.
    assert zero_memory_per_gpu_bytes(7e9, 8, 1) == pytest.approx((4 + 12 / 8) * 7e9)
    assert zero_memory_per_gpu_bytes(7e9, 8, 1, "fp32") == pytest.approx((8 + 8 / 8) * 7e9)
    with pytest.raises(ValueError, match="ZeRO stages are 0"):
        zero_memory_per_gpu_bytes(7e9, 8, 4)
    with pytest.raises(ValueError, match="use 'bf16' or 'fp32'"):
        zero_memory_per_gpu_bytes(7e9, 8, 1, "fp8")


def test_pipeline_bubble_figures():
    assert round(pipeline_bubble(8, 32) * 100, 1) == 17.9  # 7/39
    assert round(pipeline_bubble(8, 64) * 100, 1) == 9.9  # 7/71
    assert round(pipeline_bubble(8, 32, virtual_stages=4) * 100, 1) == 5.5  # 7/128
    assert pipeline_bubble(1, 8) == 0.0


def test_activation_formula_against_a_hand_computation_and_tp_divides_it():
    # s=2048, b=2, h=1024, a=16: s·b·h = 4,194,304; 34 + 5·16·2048/1024 = 194.
    assert activation_bytes_per_layer(2048, 2, 1024, 16) == 4_194_304 * 194
    assert activation_bytes_per_layer(2048, 2, 1024, 16, tp=4) == 4_194_304 * 194 / 4
    # Full checkpointing keeps the layer input only: 2·s·b·h, sequence-parallel under tp.
    assert activation_bytes_per_layer(2048, 2, 1024, 16, checkpointed=True) == 2 * 4_194_304
    assert activation_bytes_per_layer(2048, 2, 1024, 16, tp=2, checkpointed=True) == 4_194_304


def test_params_from_dims():
    gpt = ModelShape.from_dims(layers=24, hidden=1024, heads=16, vocab=50000)
    assert gpt.params == 12 * 24 * 1024**2 + 2 * 50000 * 1024
    # Llama-2-7B: SwiGLU ffn 11008. The published 6,738,415,616 adds the RMSNorm
    # weights, (2·32 + 1)·4096 = 266,240, which the formula leaves out.
    llama = ModelShape.from_dims(layers=32, hidden=4096, heads=32, vocab=32000, ffn_hidden=11008)
    assert llama.params == 6_738_415_616 - 266_240


def test_model_training_and_cluster_errors_say_how_to_fix_them():
    with pytest.raises(ValueError, match="give all three"):
        ModelShape(params=7e9, layers=32)
    with pytest.raises(ValueError, match="hidden=100 is not divisible by heads=3"):
        ModelShape(params=7e9, layers=2, hidden=100, heads=3)
    with pytest.raises(ValueError, match="give the parameter count"):
        ModelShape(params=0)
    with pytest.raises(ValueError, match=r"headroom=0.05: give a fraction between 0.1 and 0.2"):
        Training(headroom=0.05)
    with pytest.raises(ValueError, match="use 'adam' or 'adamw'"):
        Training(optimizer="sgd")
    with pytest.raises(ValueError, match="use pp_schedule='1f1b', or virtual_stages >= 2"):
        Training(pp_schedule="interleaved_1f1b", virtual_stages=1)
    with pytest.raises(ValueError, match="e.g. 80 for an H100"):
        Cluster(world_size=8, gpus_per_node=8, gpu_memory_gb=0)


def test_layout_text_round_trips_and_parse_errors_are_clear():
    assert str(Layout(dp_shard=4)) == "dp_shard=4"
    assert str(Layout()) == "dp_shard=1"
    assert (
        str(Layout(dp_replicate=2, dp_shard=4, tp=8, pp=2)) == "dp_replicate=2,dp_shard=4,tp=8,pp=2"
    )
    assert Layout.parse("dp_shard=2,tp=2") == Layout(dp_shard=2, tp=2)
    assert Layout.parse(" tp = 8 , pp=2") == Layout(tp=8, pp=2)
    assert Layout.parse("dp_shard=2,tp=2").world_size == 4
    for text in ("dp_replicate=2,dp_shard=4,tp=8,pp=2", "tp=8", "dp_shard=1"):
        assert str(Layout.parse(text)) == text
    with pytest.raises(
        LayoutError, match="'cp=2' is not NAME=SIZE with NAME one of dp_replicate, dp_shard, tp, pp"
    ):
        Layout.parse("dp_shard=2,cp=2")
    with pytest.raises(LayoutError, match="SIZE a positive integer"):
        Layout.parse("tp=0")
    with pytest.raises(LayoutError, match="gives tp twice"):
        Layout.parse("tp=2,tp=4")
    with pytest.raises(LayoutError, match="empty layout"):
        Layout.parse(" ")
    with pytest.raises(LayoutError, match="use 1 for an axis that is not split"):
        Layout(pp=0)


def test_validate_layout_names_each_problem_and_its_fix():
    small = ModelShape(params=1e9, layers=12, hidden=18, heads=6, vocab=100)
    node8 = Cluster(world_size=8, gpus_per_node=8, gpu_memory_gb=80)
    plain = Training()

    def error(layout, model=small, cluster=node8, training=plain):
        with pytest.raises(LayoutError) as caught:
            validate_layout(layout, model, cluster, training)
        return str(caught.value)

    assert (
        "layout dp_shard=4: it spans 4 GPUs but world_size is 8; make "
        "dp_replicate×dp_shard×tp×pp = 8, e.g. dp_shard=8"
    ) == error(Layout(dp_shard=4))
    assert (
        "tp=16 must divide gpus_per_node=8 so each tensor-parallel group stays on one "
        "node's NVLink; use tp in [1, 2, 4, 8]"
    ) in error(Layout(tp=16), cluster=Cluster(16, 8, 80))
    assert (
        "tp=4 does not divide heads=6; each tensor-parallel rank needs whole heads: "
        "use tp in [1, 2]" in error(Layout(dp_shard=2, tp=4))
    )
    assert "tp=4 does not divide hidden=18" in error(Layout(dp_shard=2, tp=4))
    assert (
        "pp=16 is more than layers=12; each pipeline stage needs at least one layer: use pp <= 12"
    ) in error(Layout(pp=16), cluster=Cluster(16, 8, 80), training=Training(microbatches=16))
    interleaved = Training(pp_schedule="interleaved_1f1b", virtual_stages=2)
    assert (
        "layers=12 is not divisible by pp×virtual_stages=8×2=16; interleaved 1F1B gives "
        "every rank 2 equal chunks"
    ) in error(Layout(pp=8), training=interleaved)
    assert (
        "microbatches=2 is fewer than pp=4; 1F1B needs at least one micro-batch per stage"
    ) in error(Layout(dp_shard=2, pp=4), training=Training(microbatches=2))
    # GPipe runs with fewer micro-batches than stages (all bubble, but valid).
    validate_layout(
        Layout(dp_shard=2, pp=4), small, node8, Training(microbatches=2, pp_schedule="gpipe")
    )
    assert (
        "global_batch=6 does not divide by the data-parallel size dp_replicate×dp_shard"
        "=4; every data-parallel rank takes the same number of samples: use a "
        "global_batch that is a multiple of 4"
    ) in error(Layout(dp_replicate=2, dp_shard=2, pp=2), training=Training(global_batch=6))
    # Every problem is listed at once, so one edit fixes them all.
    both = error(Layout(dp_shard=2, tp=4), training=Training(global_batch=3))
    assert "heads=6" in both and "global_batch=3" in both


def test_70b_on_64_h100s_ddp_does_not_fit_and_the_best_does():
    training = Training(seq_len=4096, activation_checkpointing=True)
    ranked = candidates(LLAMA_70B, H100_x64, training)
    assert ranked and all(c.layout.world_size == 64 for c in ranked)
    assert all(c.layout.tp <= 8 and c.reason for c in ranked)
    by_layout = {str(c.layout): c for c in ranked}
    ddp = by_layout["dp_replicate=64"]
    assert ddp.zero_stage == 0 and not ddp.fits
    assert (
        ddp.memory.weights_bytes + ddp.memory.gradients_bytes + ddp.memory.optimizer_bytes
        == pytest.approx(1120e9)
    )
    assert "shard it over data parallel with dp_shard > 1" in ddp.reason
    fsdp = by_layout["dp_shard=64"]
    assert fsdp.zero_stage == 3 and fsdp.fits
    assert (
        fsdp.memory.weights_bytes + fsdp.memory.gradients_bytes + fsdp.memory.optimizer_bytes
    ) == pytest.approx(17.5e9)
    top = best(LLAMA_70B, H100_x64, training)
    assert top == ranked[0] and top.fits
    assert top.memory.total_bytes <= 80e9
    assert top.reason.startswith("fits: ")
    # Fitting meshes come first; the rest follow from the closest to fitting.
    fits = [c.fits for c in ranked]
    assert fits == sorted(fits, reverse=True)
    rest = [c.memory.total_bytes for c in ranked if not c.fits]
    assert rest == sorted(rest)
    assert candidates(LLAMA_70B, H100_x64, training) == ranked  # deterministic

    text = table(ranked)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["rank", "layout", "ZeRO", "weights"]
    assert len(lines) == len(ranked) + 1
    assert str(top.layout) in lines[1] and " yes " in lines[1]
    ddp_row = next(line for line in lines if " dp_replicate=64 " in line)
    assert ddp_row.split()[3:6] == ["140.0", "140.0", "840.0"]  # 2 + 2 + 12 bytes × 70e9
    assert " no " in ddp_row
    rows = json.loads(json.dumps(to_json(ranked)))
    assert rows[0]["rank"] == 1 and rows[0]["layout"] == str(top.layout)
    assert rows[0]["memory"]["total_bytes"] == pytest.approx(top.memory.total_bytes)


def test_70b_without_checkpointing_does_not_fit_and_no_fit_says_what_to_change():
    training = Training(seq_len=4096)
    with pytest.raises(NoFit) as caught:
        best(LLAMA_70B, H100_x64, training)
    smallest = candidates(LLAMA_70B, H100_x64, training)[0]
    need_gb = smallest.memory.total_bytes / GB
    message = str(caught.value)
    assert message.startswith("no layout of 64 GPUs fits 70.0B parameters in 80.0 GB per GPU")
    assert f"the smallest, {smallest.layout}, needs {need_gb:,.1f} GB" in message
    assert "largest part activations" in message
    assert "turn on activation_checkpointing" in message
    assert f"use GPUs with at least {need_gb:,.1f} GB" in message


def test_memory_breakdown_tp_divides_activations_and_headroom_is_a_share_of_the_rest():
    training = Training(seq_len=4096, activation_checkpointing=True)
    by_layout = {str(c.layout): c for c in candidates(LLAMA_70B, H100_x64, training)}
    one, eight = by_layout["dp_shard=64"].memory, by_layout["dp_shard=8,tp=8"].memory
    assert eight.activations_bytes == pytest.approx(one.activations_bytes / 8)
    rest = one.total_bytes - one.headroom_bytes
    assert one.headroom_bytes == pytest.approx(0.15 * rest)


def test_communication_per_step_for_ddp_and_fsdp():
    # No shape: only data-parallel traffic is priced, and the reason says what is missing.
    seven = ModelShape(params=7e9)
    node = Cluster(world_size=4, gpus_per_node=4, gpu_memory_gb=1000)
    by_layout = {str(c.layout): c for c in candidates(seven, node, Training())}
    # DDP ring all-reduce of bf16 gradients: 2·(N−1)/N·2Ψ.
    assert by_layout["dp_replicate=4"].comm_bytes_per_step == pytest.approx(2 * 3 / 4 * 2 * 7e9)
    # FSDP: two all-gathers of bf16 weights and a reduce-scatter of grads, 3·(N−1)/N·2Ψ.
    assert by_layout["dp_shard=4"].comm_bytes_per_step == pytest.approx(3 * 3 / 4 * 2 * 7e9)
    assert all("activations and FSDP buffers not counted" in c.reason for c in by_layout.values())


def test_pipeline_schedules_change_what_the_first_stage_holds():
    model = ModelShape.from_dims(layers=8, hidden=1024, heads=16, vocab=0)
    node = Cluster(world_size=4, gpus_per_node=4, gpu_memory_gb=1000)

    def activations(schedule):
        training = Training(seq_len=1024, microbatches=8, pp_schedule=schedule)
        return {str(c.layout): c for c in candidates(model, node, training)}["pp=4"]

    per_layer = activation_bytes_per_layer(1024, 1, 1024, 16)
    # 1F1B: pp micro-batches of L/pp layers on the first stage, i.e. all L layers' worth.
    assert activations("1f1b").memory.activations_bytes == pytest.approx(8 * per_layer)
    assert activations("1f1b").bubble == pytest.approx(3 / 11)
    # GPipe: all m micro-batches.
    assert activations("gpipe").memory.activations_bytes == pytest.approx(8 * 2 * per_layer)


def test_best_on_a_tiny_model_with_two_gpus_and_no_fit_on_an_impossible_one():
    tiny = ModelShape.from_dims(layers=4, hidden=256, heads=4, vocab=1000)
    top = best(
        tiny, Cluster(world_size=2, gpus_per_node=2, gpu_memory_gb=80), Training(seq_len=512)
    )
    assert top.fits and top.layout.world_size == 2 and top.layout.tp <= 2

    with pytest.raises(NoFit) as caught:
        best(
            ModelShape(params=7e9),
            Cluster(world_size=2, gpus_per_node=2, gpu_memory_gb=24),
            Training(),
        )
    # FSDP over 2: 112 GB / 2 = 56 GB, plus 15 % headroom = 64.4 GB.
    assert str(caught.value) == (
        "no layout of 2 GPUs fits 7.0B parameters in 24.0 GB per GPU: the smallest, "
        "dp_shard=2, needs 64.4 GB (incl. 15% headroom), largest part optimizer state "
        "42.0 GB. To fit: use at least 6 GPUs (the 112.0 GB of weights, gradients and "
        "optimizer state alone need that many, fully sharded with headroom); or use GPUs "
        "with at least 64.4 GB"
    )


def test_no_valid_layout_says_why():
    model = ModelShape(params=1e6, layers=2, hidden=64, heads=4)
    with pytest.raises(
        NoFit, match="no valid layout for 3 GPUs: layout dp_shard=3: global_batch=4 does not divide"
    ):
        best(
            model,
            Cluster(world_size=3, gpus_per_node=8, gpu_memory_gb=80),
            Training(global_batch=4),
        )
