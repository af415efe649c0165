"""The memory and bubble model, per GPU: optimizer state under ZeRO, activations
(Korthikanti et al. 2022), FSDP gather buffers, the pipeline bubble. Pure; bytes."""

from __future__ import annotations

import math

from orchestrator.planner.shapes import (
    ACTIVATION_BYTES,
    NETWORK_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    STATE_BYTES_PER_PARAM,
    ModelShape,
    Training,
)


def state_bytes_per_gpu(
    params: float, shard: int, stage: int, precision: str
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU for ``params`` parameters under ZeRO
    ``stage`` over a shard group of ``shard`` GPUs: stage 1 shards the optimizer state,
    2 also the gradients, 3 also the weights."""
    weight_b, grad_b, optim_b = STATE_BYTES_PER_PARAM[precision]
    return (
        params * weight_b / (shard if stage >= 3 else 1),
        params * grad_b / (shard if stage >= 2 else 1),
        params * optim_b / (shard if stage >= 1 else 1),
    )


def zero_memory_per_gpu_bytes(params: float, dp: int, stage: int, precision: str = "bf16") -> float:
    """Bytes of weights, gradients and Adam state per GPU for ``params`` parameters under
    ZeRO ``stage`` over ``dp`` GPUs. For bf16 (Ψ = params): stage 0 (DDP) 16Ψ, 1
    4Ψ + 12Ψ/dp, 2 2Ψ + 14Ψ/dp, 3 (FSDP) 16Ψ/dp; fp32 splits the 16 as 4 + 4 + 8."""
    if not params > 0:
        raise ValueError(f"params={params!r}: give a positive parameter count")
    if dp < 1:
        raise ValueError(f"dp={dp}: the shard group has at least 1 GPU")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0 (DDP), 1, 2 and 3 (FSDP)")
    if precision not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"precision={precision!r}: use 'bf16' or 'fp32'")
    return sum(state_bytes_per_gpu(params, dp, stage, precision))


def pipeline_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The pipeline's idle share: (p−1)/(m+p−1) for GPipe and 1F1B (v = 1), and
    Narayanan et al.'s (p−1)/(v·m) for interleaved 1F1B with v model chunks per rank
    (bubble time over ideal time, which it approaches for v·m ≫ p). 0 without a
    pipeline."""
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"pp={pp}, microbatches={microbatches}, "
            f"virtual_stages={virtual_stages}: each must be at least 1"
        )
    if virtual_stages == 1:
        return (pp - 1) / (microbatches + pp - 1)
    return (pp - 1) / (virtual_stages * microbatches)


def activation_bytes_per_layer(
    seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, checkpointed: bool = False
) -> float:
    """Activation bytes one transformer layer keeps for backward, per micro-batch per GPU.

    Korthikanti et al. 2022, 16-bit activations, no recomputation:
    s·b·h·(34 + 5·a·s/h), where 34·s·b·h is the linear layers, norms and dropouts and
    5·a·s²·b the attention scores, softmax and its dropout (an attention kernel that never
    materialises the scores, such as FlashAttention, removes most of that term). Tensor
    parallel with sequence parallel divides all of it by tp. With full activation
    checkpointing a layer keeps only its input, 2·s·b·h (also split by tp under
    sequence parallel).
    """
    sbh = seq_len * micro_batch * hidden
    if checkpointed:
        return 2 * sbh / tp
    return sbh * (34 + 5 * heads * seq_len / hidden) / tp


def activation_bytes(model: ModelShape, training: Training, tp: int, pp: int) -> float:
    """Activation bytes on the pipeline stage that holds the most.

    A stage runs ceil(L/pp) layers. Without a pipeline one micro-batch is in flight at a
    time. GPipe keeps all m micro-batches on every stage; 1F1B keeps up to pp on the
    first stage and 1 on the last; interleaved 1F1B keeps pp·(1 + (pp−1)/(pp·v)) on the
    first (Korthikanti et al. §4.2.3). The last stage also keeps the fp32 logits for the
    loss, 4·s·b·V/tp. Checkpointing adds one layer's full activations: the working set
    of the layer being recomputed.
    """
    s, b, h, a = training.seq_len, training.micro_batch, model.hidden, model.heads
    m, v = training.microbatches, training.virtual_stages_used
    scale = ACTIVATION_BYTES[training.precision] / 2
    checkpointed = training.activation_checkpointing
    kept_per_layer = activation_bytes_per_layer(s, b, h, a, tp, checkpointed) * scale
    stage_layers = math.ceil(model.layers / pp)
    if pp == 1:
        first = last = stage_layers
    elif training.pp_schedule == "gpipe":
        first = last = m * stage_layers
    elif training.pp_schedule == "1f1b":
        first, last = pp * stage_layers, stage_layers
    else:
        first, last = pp * stage_layers * (1 + (pp - 1) / (pp * v)), stage_layers
    logits = 4 * s * b * model.vocab / tp
    recompute = activation_bytes_per_layer(s, b, h, a, tp) * scale if checkpointed else 0.0
    return max(kept_per_layer * first, kept_per_layer * last + logits) + recompute


def gather_buffer_bytes(model: ModelShape, precision: str, tp: int) -> float:
    """FSDP's unsharded buffers: the unit being computed and the one being prefetched
    (2 × weight bytes) plus one unit's full gradients before the reduce-scatter (1 ×
    gradient bytes), for the largest unit. Units are the layers, (Ψ − 2·V·h)/L
    parameters each, and the embeddings, V·h each, both split by tp."""
    weight_b, grad_b, _ = STATE_BYTES_PER_PARAM[precision]
    embedding = model.vocab * model.hidden
    layer = max(model.params - 2 * embedding, 0.0) / model.layers
    return max(layer, embedding) / tp * (2 * weight_b + grad_b)


def group_bytes_per_s(span: int, gpus_per_node: int) -> float:
    """Bandwidth of a group spread over ``span`` consecutive ranks: NVLink when those
    ranks sit in one node, the network otherwise."""
    inside = span <= gpus_per_node and gpus_per_node % span == 0
    return NVLINK_BYTES_PER_S if inside else NETWORK_BYTES_PER_S
