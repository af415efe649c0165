"""Pricing and ranking meshes: which layouts are valid for a model on a cluster, what
each costs in memory, communication and bubble, why, and which is best."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.layout import Layout, LayoutError
from orchestrator.planner.memory import (
    activation_bytes,
    gather_buffer_bytes,
    group_bytes_per_s,
    pipeline_bubble,
    state_bytes_per_gpu,
)
from orchestrator.planner.shapes import (
    ACTIVATION_BYTES,
    GB,
    NOMINAL_FLOP_PER_S,
    NVLINK_BYTES_PER_S,
    STATE_BYTES_PER_PARAM,
    Cluster,
    ModelShape,
    Training,
)


class NoFit(ValueError):
    """No valid mesh fits in GPU memory; the message gives the smallest need and the fix."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU, on the fullest pipeline stage."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    headroom_bytes: float

    @property
    def total_bytes(self) -> float:
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.buffers_bytes
            + self.headroom_bytes
        )


@dataclass(frozen=True)
class Candidate:
    """One priced mesh. ``zero_stage`` 0–3 (3 = FSDP); ``comm_bytes_per_step`` bytes this
    GPU sends per optimizer step; ``bubble`` the pipeline's idle fraction (0–1);
    ``fits`` whether ``memory.total_bytes`` is within the GPU's memory; ``reason`` says
    why, and what to change when it does not fit."""

    layout: Layout
    zero_stage: int
    memory: MemoryBreakdown
    comm_bytes_per_step: float
    bubble: float
    fits: bool
    reason: str


def _problems(layout: Layout, model: ModelShape, cluster: Cluster, training: Training) -> list[str]:
    """Everything that keeps ``layout`` from running, each with its fix."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    tp, pp, dp = layout.tp, layout.pp, layout.dp_size
    problems = []
    if layout.world_size != world:
        keep = tp * pp
        example = (
            Layout(dp_shard=world // keep, tp=tp, pp=pp)
            if world % keep == 0
            else Layout(dp_shard=world)
        )
        problems.append(
            f"it spans {layout.world_size} GPUs but world_size is {world}; "
            f"make dp_replicate×dp_shard×tp×pp = {world}, e.g. {example}"
        )
    node_tps = [t for t in range(1, per_node + 1) if per_node % t == 0]
    if tp not in node_tps:
        problems.append(
            f"tp={tp} must divide gpus_per_node={per_node} so each tensor-"
            f"parallel group stays on one node's NVLink; use tp in {node_tps}"
        )
    if model.has_shape:
        fit = [t for t in node_tps if model.heads % t == 0 and model.hidden % t == 0]
        if model.heads % tp:
            problems.append(
                f"tp={tp} does not divide heads={model.heads}; each tensor-"
                f"parallel rank needs whole heads: use tp in {fit}"
            )
        if model.hidden % tp:
            problems.append(
                f"tp={tp} does not divide hidden={model.hidden}; each tensor-"
                f"parallel rank takes hidden/tp columns: use tp in {fit}"
            )
        if pp > model.layers:
            problems.append(
                f"pp={pp} is more than layers={model.layers}; each pipeline "
                f"stage needs at least one layer: use pp <= {model.layers}"
            )
        v = training.virtual_stages_used
        if pp > 1 and v > 1 and model.layers % (pp * v):
            problems.append(
                f"layers={model.layers} is not divisible by pp×virtual_stages="
                f"{pp}×{v}={pp * v}; interleaved 1F1B gives every rank {v} "
                f"equal chunks: pick pp and virtual_stages whose product "
                f"divides {model.layers}, or pp_schedule='1f1b'"
            )
    if pp > 1 and training.pp_schedule != "gpipe" and training.microbatches < pp:
        problems.append(
            f"microbatches={training.microbatches} is fewer than pp={pp}; 1F1B "
            f"needs at least one micro-batch per stage to fill the pipeline: "
            f"use microbatches >= {pp}, and more to shrink the bubble "
            f"(p-1)/(m+p-1)"
        )
    if training.global_batch is not None and training.global_batch % dp:
        problems.append(
            f"global_batch={training.global_batch} does not divide by the data-"
            f"parallel size dp_replicate×dp_shard={dp}; every data-parallel "
            f"rank takes the same number of samples: use a global_batch that "
            f"is a multiple of {dp}, or a layout whose data-parallel size "
            f"divides {training.global_batch}"
        )
    return problems


def validate_layout(
    layout: Layout, model: ModelShape, cluster: Cluster, training: Training
) -> None:
    """Raises ``LayoutError`` listing every reason ``layout`` cannot run, each with its
    fix: the GPU count, tp inside a node and dividing heads and hidden, pp at most the
    layer count, interleaved chunks dividing the layers, 1F1B's micro-batches filling the
    pipeline, and the global batch dividing by the data-parallel size."""
    problems = _problems(layout, model, cluster, training)
    if problems:
        raise LayoutError(f"layout {layout}: " + "; ".join(problems))


@dataclass(frozen=True)
class _Priced:
    layout: Layout
    zero_stage: int
    memory: MemoryBreakdown
    comm_bytes_per_step: float
    bubble: float
    fits: bool
    compute_s: float  # this GPU's arithmetic per step at the nominal FLOP/s
    comm_s: float  # all its communication per step at the nominal bandwidths
    step_s: float  # the estimated step: see _price
    sample_s: float  # step_s per sample the whole job trains in that step


def _price(layout: Layout, model: ModelShape, cluster: Cluster, training: Training) -> _Priced:
    """Memory, communication and estimated time of one valid mesh.

    Communication per GPU per optimizer step, bytes sent (P = Ψ/(tp·pp), w and g the
    weight and gradient bytes per parameter, N = dp_shard, R = dp_replicate, a the
    activation bytes, S = s·b·h):

    - DDP (N = 1): ring all-reduce of the gradients, 2·(R−1)/R·g·P.
    - FSDP (N > 1): all-gather of the weights in forward and again in backward plus a
      reduce-scatter of the gradients, (N−1)/N·(2·w + g)·P (≈ 3·(N−1)/N·w·P); HSDP adds
      an all-reduce of the gradient shard over the replicas, 2·(R−1)/R·g·P/N. Counted
      once per step, as if the gathered weights were kept across micro-batches.
    - tensor parallel: 4 all-reduces (or all-gather + reduce-scatter pairs under sequence
      parallel, the same volume) per layer per micro-batch, each 2·(tp−1)/tp·S·a; 6 with
      checkpointing, whose recomputed forward repeats two.
    - pipeline: each micro-batch's activations forward and gradients backward, S·a/tp
      each (every tp rank sends its sequence-parallel slice), v times under interleaving.

    Time, with the nominal FLOP/s and bandwidths above, a group on NVLink when its ranks
    share a node: compute is 6·Ψ FLOPs per token (8·Ψ with recomputation) over tp·pp
    GPUs; tensor- and pipeline-parallel transfers sit on the critical path; the bubble
    stretches both, step = (compute + tp + pp)/(1 − bubble); data-parallel transfers
    overlap compute and add only what outlasts it.
    """
    r, n, tp, pp = layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp
    s, b, m = training.seq_len, training.micro_batch, training.microbatches
    v = training.virtual_stages_used
    precision, checkpointed = training.precision, training.activation_checkpointing
    weight_b, grad_b, _ = STATE_BYTES_PER_PARAM[precision]
    act_b = ACTIVATION_BYTES[precision]
    per_node = cluster.gpus_per_node

    zero_stage = 3 if n > 1 else 0
    shard_params = model.params / (tp * pp)
    weights, gradients, optimizer = state_bytes_per_gpu(shard_params, n, zero_stage, precision)
    activations = buffers = 0.0
    tp_bytes = pp_bytes = 0.0
    if model.has_shape:
        activations = activation_bytes(model, training, tp, pp)
        if zero_stage == 3:
            buffers = gather_buffer_bytes(model, precision, tp)
        sbh_bytes = s * b * model.hidden * act_b
        if tp > 1:
            collectives = 6 if checkpointed else 4
            tp_bytes = (
                collectives * 2 * (tp - 1) / tp * sbh_bytes * math.ceil(model.layers / pp) * m
            )
        if pp > 1:
            pp_bytes = 2 * sbh_bytes / tp * m * v
    used = weights + gradients + optimizer + activations + buffers
    memory = MemoryBreakdown(
        weights, gradients, optimizer, activations, buffers, training.headroom * used
    )

    if zero_stage == 0:
        shard_bytes, replica_bytes = 0.0, 2 * (r - 1) / r * grad_b * shard_params
    else:
        shard_bytes = (n - 1) / n * (2 * weight_b + grad_b) * shard_params
        replica_bytes = 2 * (r - 1) / r * grad_b * shard_params / n
    dp_s = shard_bytes / group_bytes_per_s(n * tp, per_node) + replica_bytes / group_bytes_per_s(
        r * n * tp, per_node
    )
    tp_s = tp_bytes / NVLINK_BYTES_PER_S
    pp_s = pp_bytes / group_bytes_per_s(cluster.world_size, per_node)
    flops_per_token = (8 if checkpointed else 6) * model.params
    compute_s = flops_per_token * m * b * s / (tp * pp) / NOMINAL_FLOP_PER_S
    bubble = pipeline_bubble(pp, m, v)
    step_s = (compute_s + tp_s + pp_s) / (1 - bubble) + max(0.0, dp_s - compute_s)
    return _Priced(
        layout,
        zero_stage,
        memory,
        shard_bytes + replica_bytes + tp_bytes + pp_bytes,
        bubble,
        memory.total_bytes <= cluster.gpu_memory_gb * GB,
        compute_s,
        dp_s + tp_s + pp_s,
        step_s,
        step_s / (layout.dp_size * m * b),
    )


def _layouts(world_size: int) -> list[Layout]:
    """Every (dp_replicate, dp_shard, tp, pp) whose product is ``world_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    found = []
    for pp in divisors:
        for tp in divisors:
            if (world_size // pp) % tp:
                continue
            dp = world_size // (pp * tp)
            for shard in divisors:
                if dp % shard == 0:
                    found.append(Layout(dp // shard, shard, tp, pp))
    return found


def _count(params: float) -> str:
    """A parameter count the way people say it: "70.0B", "125.0M"."""
    if params >= 1e9:
        return f"{params / 1e9:,.1f}B"
    if params >= 1e6:
        return f"{params / 1e6:,.1f}M"
    return f"{params:,.0f}"


_PART_NAMES = ("weights", "gradients", "optimizer state", "activations", "buffers")


def _largest_part(memory: MemoryBreakdown) -> tuple[str, float]:
    parts = (
        memory.weights_bytes,
        memory.gradients_bytes,
        memory.optimizer_bytes,
        memory.activations_bytes,
        memory.buffers_bytes,
    )
    i = max(range(len(parts)), key=lambda k: parts[k])
    return _PART_NAMES[i], parts[i]


def _describe(p: _Priced) -> list[str]:
    """What the mesh does with the model, in words."""
    lay = p.layout
    said = []
    if lay.dp_shard > 1 and lay.dp_replicate == 1:
        said.append(f"FSDP shards weights, gradients and optimizer state over {lay.dp_shard} GPUs")
    elif lay.dp_shard > 1:
        said.append(
            f"HSDP shards the state over {lay.dp_shard} GPUs and replicates it {lay.dp_replicate}×"
        )
    elif lay.dp_replicate > 1:
        said.append(f"DDP keeps the full state on each of {lay.dp_replicate} replicas")
    if lay.tp > 1:
        said.append(f"tp={lay.tp} splits every layer and its activations inside a node")
    if lay.pp > 1:
        said.append(f"pp={lay.pp} stages idle {p.bubble:.1%} of the step in the bubble")
    if lay.tp == 1 and lay.pp == 1:
        said.append("no model parallelism")
    return said


def _reason(
    p: _Priced, best_sample_s: float | None, model: ModelShape, cluster: Cluster, training: Training
) -> str:
    total_gb, capacity_gb = p.memory.total_bytes / GB, cluster.gpu_memory_gb
    if p.fits:
        said = [f"fits: {total_gb:,.1f} of {capacity_gb:,.1f} GB"] + _describe(p)
        exposed = (p.step_s - p.compute_s / (1 - p.bubble)) / p.step_s
        said.append(
            f"est. {p.sample_s / best_sample_s:.2f}× the best time per sample, "
            f"{exposed:.0%} of the step waiting on communication"
        )
    else:
        said = [f"does not fit: needs {total_gb:,.1f} GB > {capacity_gb:,.1f} GB"]
        said += _describe(p)
        part, part_bytes = _largest_part(p.memory)
        if part == "activations":
            fix = (
                "turn on activation_checkpointing or raise tp"
                if not training.activation_checkpointing
                else "raise tp, or lower seq_len or micro_batch"
            )
        elif part == "buffers":
            fix = "raise tp to split each layer"
        elif p.layout.dp_shard == 1:
            fix = "shard it over data parallel with dp_shard > 1"
        else:
            fix = "shard it further with more dp_shard, tp or pp"
        said.append(f"largest part {part} {part_bytes / GB:,.1f} GB: {fix}")
    if not model.has_shape:
        said.append("activations and FSDP buffers not counted: give layers, hidden and heads")
    return "; ".join(said)


def candidates(model: ModelShape, cluster: Cluster, training: Training) -> list[Candidate]:
    """Every valid mesh for exactly ``cluster.world_size`` GPUs, priced and ranked.

    Valid: passes ``validate_layout``. Any dp_replicate × dp_shard split of the data-
    parallel size is offered: dp_shard = 1 is DDP, dp_replicate = 1 is FSDP, both > 1
    HSDP (see the module docstring for the ZeRO stage each maps to).

    Ranking: meshes that fit come first, by estimated time per trained sample (step time
    from ``_price`` over dp × microbatches × micro_batch samples; it counts exposed
    communication and the bubble). Ties — common when data-parallel traffic hides
    entirely behind compute, and whenever the shape is unknown so tensor- and pipeline-
    parallel traffic cannot be priced — go to fewer model-parallel GPUs (tp·pp), then to
    less total communication time (more slack before it shows), lower pp, lower tp, less
    memory and finally the layout's text, so the order is deterministic. Meshes that do
    not fit follow, the closest to fitting (least memory) first.
    """
    priced = [
        _price(layout, model, cluster, training)
        for layout in _layouts(cluster.world_size)
        if not _problems(layout, model, cluster, training)
    ]
    fitting = sorted(
        (p for p in priced if p.fits),
        key=lambda p: (
            p.sample_s,
            p.layout.tp * p.layout.pp,
            p.comm_s,
            p.layout.pp,
            p.layout.tp,
            p.memory.total_bytes,
            str(p.layout),
        ),
    )
    too_big = sorted(
        (p for p in priced if not p.fits), key=lambda p: (p.memory.total_bytes, str(p.layout))
    )
    best_sample_s = fitting[0].sample_s if fitting else None
    return [
        Candidate(
            p.layout,
            p.zero_stage,
            p.memory,
            p.comm_bytes_per_step,
            p.bubble,
            p.fits,
            _reason(p, best_sample_s, model, cluster, training),
        )
        for p in fitting + too_big
    ]


def best(model: ModelShape, cluster: Cluster, training: Training) -> Candidate:
    """The top-ranked mesh that fits. Raises ``NoFit`` with the smallest per-GPU memory
    any valid mesh needs, the GPU's memory, and what to change."""
    ranked = candidates(model, cluster, training)
    if ranked and ranked[0].fits:
        return ranked[0]
    world = cluster.world_size
    if not ranked:
        # Pure FSDP over every GPU is valid whenever anything is, so its error explains.
        try:
            validate_layout(Layout(dp_shard=world), model, cluster, training)
        except LayoutError as e:
            raise NoFit(f"no valid layout for {world} GPUs: {e}") from None
    smallest = ranked[0]
    need_gb = smallest.memory.total_bytes / GB
    part, part_bytes = _largest_part(smallest.memory)
    fixes = []
    if part == "activations":
        if not training.activation_checkpointing:
            fixes.append("turn on activation_checkpointing")
        fixes.append(f"lower seq_len ({training.seq_len}) or micro_batch ({training.micro_batch})")
    else:
        state_bytes = sum(STATE_BYTES_PER_PARAM[training.precision]) * model.params
        gpus = math.ceil(state_bytes * (1 + training.headroom) / (cluster.gpu_memory_gb * GB))
        if gpus > world:
            fixes.append(
                f"use at least {gpus} GPUs (the {state_bytes / GB:,.1f} GB of "
                f"weights, gradients and optimizer state alone need that many, "
                f"fully sharded with headroom)"
            )
        else:
            fixes.append("use more GPUs to shard the state further")
    fixes.append(f"use GPUs with at least {need_gb:,.1f} GB")
    raise NoFit(
        f"no layout of {world} GPUs fits {_count(model.params)} parameters in "
        f"{cluster.gpu_memory_gb:,.1f} GB per GPU: the smallest, {smallest.layout}, "
        f"needs {need_gb:,.1f} GB (incl. {training.headroom:.0%} headroom), "
        f"largest part {part} {part_bytes / GB:,.1f} GB. To fit: " + "; or ".join(fixes)
    )
