"""Layout planner: which ``dp_replicate × dp_shard × tp × pp`` mesh to train a model on. Pure.

``candidates(model, cluster, training)`` prices every valid mesh for the cluster's world
size and ranks them; ``best`` returns the top one that fits, or raises ``NoFit`` saying
what to change. Stdlib only, so the controller and the CLI call it without torch.

The model is the one practitioners use, per GPU:

- **State**: 16 bytes per parameter of Adam — bf16 training keeps 2 (weights) + 2
  (gradients) + 12 (fp32 master weights, momentum, variance); fp32 training 4 + 4 + 8.
  Tensor and pipeline parallel divide the parameters first (Ψ/(tp·pp) per GPU; the
  embeddings are spread evenly over the stages, an approximation), then ZeRO divides
  part of it over the data-parallel shard group (``zero_memory_per_gpu_bytes``).
- **Activations**: Korthikanti et al. 2022 per layer (``activation_bytes_per_layer``),
  times the layers and micro-batches the fullest pipeline stage holds, plus the fp32
  logits the loss keeps (``_activation_bytes``).
- **Buffers**: FSDP's unsharded gather buffers (``_gather_buffer_bytes``).
- **Headroom**: ``training.headroom`` (0.10–0.20) of the sum above, for allocator
  fragmentation, NCCL and the CUDA context. A mesh fits when the total is at most the
  GPU's memory.
- **Communication** and **bubble**: see ``_price`` and ``pipeline_bubble``.

Mesh → ZeRO stage: ``dp_shard > 1`` is FSDP2 (ZeRO-3: weights, gradients and optimizer
state sharded over ``dp_shard``; with ``dp_replicate > 1`` too it is HSDP, replicated
over ``dp_replicate``). ``dp_shard == 1`` is stage 0: every GPU holds the full state of
its tp×pp shard, and ``dp_replicate > 1`` is plain DDP. Meshes are not offered at ZeRO-1
or -2 because FSDP2 always shards parameters at rest; ``zero_memory_per_gpu_bytes``
still prices those stages.

Rank order: tensor-parallel groups are consecutive ranks, then ``dp_shard``, then
``dp_replicate``, with ``pp`` outermost (torchtitan's ``pp, dp_replicate, dp_shard, tp``
order). That is what keeps a tp group inside a node, and it decides which groups talk
over NVLink and which over the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.layout import AXES, Layout, LayoutError

GB = 1e9  # GPU datasheets count 10^9 bytes to the GB; so does every figure here

# Bytes per parameter of (weights, gradients, optimizer state) under Adam.
STATE_BYTES_PER_PARAM = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
# Bytes per activation element. Korthikanti's coefficients count 16-bit activations;
# fp32 doubles them (the 1-byte dropout masks they include make that a slight overcount).
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}
# AdamW keeps the same two moments as Adam; other optimizers need other state figures.
OPTIMIZERS = ("adam", "adamw")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
HEADROOM_MIN, HEADROOM_MAX = 0.10, 0.20

# Nominal H100/H200-class figures. They only weigh communication against compute and the
# bubble when ranking meshes, so what matters is their ratio, not their exact values.
NOMINAL_FLOP_PER_S = 400e12   # bf16 at about 40 % of an H100's dense peak
NVLINK_BYTES_PER_S = 450e9    # per GPU and direction, inside a node
NETWORK_BYTES_PER_S = 50e9    # one 400 Gb/s NIC per GPU, between nodes


class NoFit(ValueError):
    """No valid mesh fits in GPU memory; the message gives the smallest need and the fix."""


MAX_PARAMS = 1e15   # beyond any model; bounds the planner's arithmetic


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. ``params`` is its parameter count; ``layers``,
    ``hidden`` (model width), ``heads`` (attention heads) and ``vocab`` describe its
    shape. The shape is optional: given ``params`` alone, activation memory and FSDP
    gather buffers are unknown and counted as 0 (each candidate's reason says so), and
    the tp/pp divisibility checks that need the shape are skipped."""

    params: float
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    vocab: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.params <= MAX_PARAMS:  # also refuses NaN and infinity
            raise ValueError(f"ModelShape params={self.params!r}: give the parameter count "
                             f"(at most {MAX_PARAMS:g}), e.g. params=7e9, or build it with ModelShape.from_dims(...)")
        shape = {"layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                 "vocab": self.vocab}
        negative = [f"{k}={v}" for k, v in shape.items() if v < 0]
        if negative:
            raise ValueError(f"ModelShape {', '.join(negative)}: sizes cannot be negative; "
                             f"use 0 for unknown")
        dims = (self.layers, self.hidden, self.heads)
        if any(dims) and not all(dims):
            raise ValueError(f"ModelShape layers={self.layers}, hidden={self.hidden}, "
                             f"heads={self.heads}: give all three (activation memory needs "
                             f"each) or none of them")
        if self.heads and self.hidden % self.heads:
            raise ValueError(f"ModelShape hidden={self.hidden} is not divisible by "
                             f"heads={self.heads}; each head is hidden/heads wide, so check "
                             f"the model's config")

    @property
    def has_shape(self) -> bool:
        """Whether layers, hidden and heads are known."""
        return self.layers > 0

    @classmethod
    def from_dims(cls, layers: int, hidden: int, heads: int, vocab: int,
                  ffn_hidden: int | None = None) -> ModelShape:
        """A model from its dimensions, with params ≈ L·(4·h² + MLP) + 2·V·h.

        Attention is 4·h² per layer (Q, K, V, output). The MLP is 8·h² (GPT's two
        h×4h matrices), giving the classic 12·L·h² + 2·V·h; with ``ffn_hidden`` it is a
        SwiGLU MLP, 3·h·ffn (gate, up, down; Llama's ffn ≈ 8h/3 gives 12·L·h² again).
        2·V·h counts untied input and output embeddings. Biases and norms (under 0.1 %)
        are ignored. Grouped-query attention has smaller K/V projections: for such a
        model give the exact count, ``ModelShape(params, layers, hidden, heads, vocab)``.
        """
        mlp = 8 * hidden * hidden if ffn_hidden is None else 3 * hidden * ffn_hidden
        params = layers * (4 * hidden * hidden + mlp) + 2 * vocab * hidden
        return cls(params=float(params), layers=layers, hidden=hidden, heads=heads,
                   vocab=vocab)


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job runs on: ``world_size`` in all, ``gpus_per_node`` per node (the
    NVLink domain tensor parallel stays in), ``gpu_memory_gb`` each (1 GB = 1e9 bytes)."""

    world_size: int
    gpus_per_node: int
    gpu_memory_gb: float

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"Cluster world_size={self.world_size}: need at least 1 GPU")
        if self.gpus_per_node < 1:
            raise ValueError(f"Cluster gpus_per_node={self.gpus_per_node}: need at least 1")
        if not (math.isfinite(self.gpu_memory_gb) and self.gpu_memory_gb > 0):
            raise ValueError(f"Cluster gpu_memory_gb={self.gpu_memory_gb!r}: give each GPU's "
                             f"memory in GB of 1e9 bytes, e.g. 80 for an H100")


@dataclass(frozen=True)
class Training:
    """How the model is trained.

    ``seq_len`` tokens per sample; ``micro_batch`` samples per forward pass;
    ``global_batch`` samples per optimizer step (only checked to divide by the
    data-parallel size); ``microbatches`` micro-batches each data-parallel rank runs per
    optimizer step (the pipeline's m; gradient-accumulation steps without a pipeline);
    ``precision`` "bf16" (mixed precision) or "fp32"; ``optimizer`` "adam" or "adamw";
    ``activation_checkpointing`` recomputes each layer in the backward pass;
    ``headroom`` the fraction (0.10–0.20) of the estimate added for fragmentation and
    buffers; ``pp_schedule`` "gpipe", "1f1b" or "interleaved_1f1b", the latter with
    ``virtual_stages`` model chunks per pipeline rank.
    """

    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int | None = None
    microbatches: int = 8
    precision: str = "bf16"
    optimizer: str = "adam"
    activation_checkpointing: bool = False
    headroom: float = 0.15
    pp_schedule: str = "1f1b"
    virtual_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"Training {name}={getattr(self, name)}: must be at least 1")
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"Training global_batch={self.global_batch}: give a positive "
                             f"sample count, or None to leave it unchecked")
        if self.precision not in STATE_BYTES_PER_PARAM:
            raise ValueError(f"Training precision={self.precision!r}: use 'bf16' (mixed "
                             f"precision on GPUs) or 'fp32'")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Training optimizer={self.optimizer!r}: the planner prices "
                             f"Adam's state (two fp32 moments per parameter); use 'adam' or "
                             f"'adamw'")
        if not HEADROOM_MIN <= self.headroom <= HEADROOM_MAX:
            raise ValueError(f"Training headroom={self.headroom}: give a fraction between "
                             f"{HEADROOM_MIN} and {HEADROOM_MAX} of the estimate (default "
                             f"0.15)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"Training pp_schedule={self.pp_schedule!r}: use one of "
                             f"{', '.join(PP_SCHEDULES)}")
        if self.virtual_stages < 1:
            raise ValueError(f"Training virtual_stages={self.virtual_stages}: must be at "
                             f"least 1")
        if self.pp_schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ValueError("Training virtual_stages=1 with pp_schedule='interleaved_1f1b' "
                             "is plain 1F1B: use pp_schedule='1f1b', or virtual_stages >= 2")

    @property
    def virtual_stages_used(self) -> int:
        """Model chunks per pipeline rank: ``virtual_stages`` when interleaved, else 1."""
        return self.virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1


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
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.buffers_bytes + self.headroom_bytes)


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


def _state_bytes(params: float, shard: int, stage: int,
                 precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU for ``params`` parameters under ZeRO
    ``stage`` over a shard group of ``shard`` GPUs: stage 1 shards the optimizer state,
    2 also the gradients, 3 also the weights."""
    weight_b, grad_b, optim_b = STATE_BYTES_PER_PARAM[precision]
    return (params * weight_b / (shard if stage >= 3 else 1),
            params * grad_b / (shard if stage >= 2 else 1),
            params * optim_b / (shard if stage >= 1 else 1))


def zero_memory_per_gpu_bytes(params: float, dp: int, stage: int,
                              precision: str = "bf16") -> float:
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
    return sum(_state_bytes(params, dp, stage, precision))


def pipeline_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The pipeline's idle share: (p−1)/(m+p−1) for GPipe and 1F1B (v = 1), and
    Narayanan et al.'s (p−1)/(v·m) for interleaved 1F1B with v model chunks per rank
    (bubble time over ideal time, which it approaches for v·m ≫ p). 0 without a
    pipeline."""
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches}, "
                         f"virtual_stages={virtual_stages}: each must be at least 1")
    if virtual_stages == 1:
        return (pp - 1) / (microbatches + pp - 1)
    return (pp - 1) / (virtual_stages * microbatches)


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               tp: int = 1, checkpointed: bool = False) -> float:
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


def _activation_bytes(model: ModelShape, training: Training, tp: int, pp: int) -> float:
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
    recompute = (activation_bytes_per_layer(s, b, h, a, tp) * scale if checkpointed else 0.0)
    return max(kept_per_layer * first, kept_per_layer * last + logits) + recompute


def _gather_buffer_bytes(model: ModelShape, precision: str, tp: int) -> float:
    """FSDP's unsharded buffers: the unit being computed and the one being prefetched
    (2 × weight bytes) plus one unit's full gradients before the reduce-scatter (1 ×
    gradient bytes), for the largest unit. Units are the layers, (Ψ − 2·V·h)/L
    parameters each, and the embeddings, V·h each, both split by tp."""
    weight_b, grad_b, _ = STATE_BYTES_PER_PARAM[precision]
    embedding = model.vocab * model.hidden
    layer = max(model.params - 2 * embedding, 0.0) / model.layers
    return max(layer, embedding) / tp * (2 * weight_b + grad_b)


def _group_bytes_per_s(span: int, gpus_per_node: int) -> float:
    """Bandwidth of a group spread over ``span`` consecutive ranks: NVLink when those
    ranks sit in one node, the network otherwise."""
    inside = span <= gpus_per_node and gpus_per_node % span == 0
    return NVLINK_BYTES_PER_S if inside else NETWORK_BYTES_PER_S


def _problems(layout: Layout, model: ModelShape, cluster: Cluster,
              training: Training) -> list[str]:
    """Everything that keeps ``layout`` from running, each with its fix."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    tp, pp, dp = layout.tp, layout.pp, layout.dp_size
    problems = []
    if layout.world_size != world:
        keep = tp * pp
        example = (Layout(dp_shard=world // keep, tp=tp, pp=pp) if world % keep == 0
                   else Layout(dp_shard=world))
        problems.append(f"it spans {layout.world_size} GPUs but world_size is {world}; "
                        f"make dp_replicate×dp_shard×tp×pp = {world}, e.g. {example}")
    node_tps = [t for t in range(1, per_node + 1) if per_node % t == 0]
    if tp not in node_tps:
        problems.append(f"tp={tp} must divide gpus_per_node={per_node} so each tensor-"
                        f"parallel group stays on one node's NVLink; use tp in {node_tps}")
    if model.has_shape:
        fit = [t for t in node_tps if model.heads % t == 0 and model.hidden % t == 0]
        if model.heads % tp:
            problems.append(f"tp={tp} does not divide heads={model.heads}; each tensor-"
                            f"parallel rank needs whole heads: use tp in {fit}")
        if model.hidden % tp:
            problems.append(f"tp={tp} does not divide hidden={model.hidden}; each tensor-"
                            f"parallel rank takes hidden/tp columns: use tp in {fit}")
        if pp > model.layers:
            problems.append(f"pp={pp} is more than layers={model.layers}; each pipeline "
                            f"stage needs at least one layer: use pp <= {model.layers}")
        v = training.virtual_stages_used
        if pp > 1 and v > 1 and model.layers % (pp * v):
            problems.append(f"layers={model.layers} is not divisible by pp×virtual_stages="
                            f"{pp}×{v}={pp * v}; interleaved 1F1B gives every rank {v} "
                            f"equal chunks: pick pp and virtual_stages whose product "
                            f"divides {model.layers}, or pp_schedule='1f1b'")
    if pp > 1 and training.pp_schedule != "gpipe" and training.microbatches < pp:
        problems.append(f"microbatches={training.microbatches} is fewer than pp={pp}; 1F1B "
                        f"needs at least one micro-batch per stage to fill the pipeline: "
                        f"use microbatches >= {pp}, and more to shrink the bubble "
                        f"(p-1)/(m+p-1)")
    if training.global_batch is not None and training.global_batch % dp:
        problems.append(f"global_batch={training.global_batch} does not divide by the data-"
                        f"parallel size dp_replicate×dp_shard={dp}; every data-parallel "
                        f"rank takes the same number of samples: use a global_batch that "
                        f"is a multiple of {dp}, or a layout whose data-parallel size "
                        f"divides {training.global_batch}")
    return problems


def validate_layout(layout: Layout, model: ModelShape, cluster: Cluster,
                    training: Training) -> None:
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
    compute_s: float     # this GPU's arithmetic per step at the nominal FLOP/s
    comm_s: float        # all its communication per step at the nominal bandwidths
    step_s: float        # the estimated step: see _price
    sample_s: float      # step_s per sample the whole job trains in that step


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
    weights, gradients, optimizer = _state_bytes(shard_params, n, zero_stage, precision)
    activations = buffers = 0.0
    tp_bytes = pp_bytes = 0.0
    if model.has_shape:
        activations = _activation_bytes(model, training, tp, pp)
        if zero_stage == 3:
            buffers = _gather_buffer_bytes(model, precision, tp)
        sbh_bytes = s * b * model.hidden * act_b
        if tp > 1:
            collectives = 6 if checkpointed else 4
            tp_bytes = (collectives * 2 * (tp - 1) / tp * sbh_bytes
                        * math.ceil(model.layers / pp) * m)
        if pp > 1:
            pp_bytes = 2 * sbh_bytes / tp * m * v
    used = weights + gradients + optimizer + activations + buffers
    memory = MemoryBreakdown(weights, gradients, optimizer, activations, buffers,
                             training.headroom * used)

    if zero_stage == 0:
        shard_bytes, replica_bytes = 0.0, 2 * (r - 1) / r * grad_b * shard_params
    else:
        shard_bytes = (n - 1) / n * (2 * weight_b + grad_b) * shard_params
        replica_bytes = 2 * (r - 1) / r * grad_b * shard_params / n
    dp_s = (shard_bytes / _group_bytes_per_s(n * tp, per_node)
            + replica_bytes / _group_bytes_per_s(r * n * tp, per_node))
    tp_s = tp_bytes / NVLINK_BYTES_PER_S
    pp_s = pp_bytes / _group_bytes_per_s(cluster.world_size, per_node)
    flops_per_token = (8 if checkpointed else 6) * model.params
    compute_s = flops_per_token * m * b * s / (tp * pp) / NOMINAL_FLOP_PER_S
    bubble = pipeline_bubble(pp, m, v)
    step_s = (compute_s + tp_s + pp_s) / (1 - bubble) + max(0.0, dp_s - compute_s)
    return _Priced(layout, zero_stage, memory,
                   shard_bytes + replica_bytes + tp_bytes + pp_bytes, bubble,
                   memory.total_bytes <= cluster.gpu_memory_gb * GB,
                   compute_s, dp_s + tp_s + pp_s, step_s, step_s / (layout.dp_size * m * b))


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
    parts = (memory.weights_bytes, memory.gradients_bytes, memory.optimizer_bytes,
             memory.activations_bytes, memory.buffers_bytes)
    i = max(range(len(parts)), key=lambda k: parts[k])
    return _PART_NAMES[i], parts[i]


def _describe(p: _Priced) -> list[str]:
    """What the mesh does with the model, in words."""
    lay = p.layout
    said = []
    if lay.dp_shard > 1 and lay.dp_replicate == 1:
        said.append(f"FSDP shards weights, gradients and optimizer state over "
                    f"{lay.dp_shard} GPUs")
    elif lay.dp_shard > 1:
        said.append(f"HSDP shards the state over {lay.dp_shard} GPUs and replicates it "
                    f"{lay.dp_replicate}×")
    elif lay.dp_replicate > 1:
        said.append(f"DDP keeps the full state on each of {lay.dp_replicate} replicas")
    if lay.tp > 1:
        said.append(f"tp={lay.tp} splits every layer and its activations inside a node")
    if lay.pp > 1:
        said.append(f"pp={lay.pp} stages idle {p.bubble:.1%} of the step in the bubble")
    if lay.tp == 1 and lay.pp == 1:
        said.append("no model parallelism")
    return said


def _reason(p: _Priced, best_sample_s: float | None, model: ModelShape, cluster: Cluster,
            training: Training) -> str:
    total_gb, capacity_gb = p.memory.total_bytes / GB, cluster.gpu_memory_gb
    if p.fits:
        said = [f"fits: {total_gb:,.1f} of {capacity_gb:,.1f} GB"] + _describe(p)
        exposed = (p.step_s - p.compute_s / (1 - p.bubble)) / p.step_s
        said.append(f"est. {p.sample_s / best_sample_s:.2f}× the best time per sample, "
                    f"{exposed:.0%} of the step waiting on communication")
    else:
        said = [f"does not fit: needs {total_gb:,.1f} GB > {capacity_gb:,.1f} GB"]
        said += _describe(p)
        part, part_bytes = _largest_part(p.memory)
        if part == "activations":
            fix = ("turn on activation_checkpointing or raise tp"
                   if not training.activation_checkpointing
                   else "raise tp, or lower seq_len or micro_batch")
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
    priced = [_price(layout, model, cluster, training) for layout in _layouts(cluster.world_size)
              if not _problems(layout, model, cluster, training)]
    fitting = sorted((p for p in priced if p.fits), key=lambda p: (
        p.sample_s, p.layout.tp * p.layout.pp, p.comm_s, p.layout.pp, p.layout.tp,
        p.memory.total_bytes, str(p.layout)))
    too_big = sorted((p for p in priced if not p.fits),
                     key=lambda p: (p.memory.total_bytes, str(p.layout)))
    best_sample_s = fitting[0].sample_s if fitting else None
    return [Candidate(p.layout, p.zero_stage, p.memory, p.comm_bytes_per_step, p.bubble,
                      p.fits, _reason(p, best_sample_s, model, cluster, training))
            for p in fitting + too_big]


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
        fixes.append(f"lower seq_len ({training.seq_len}) or micro_batch "
                     f"({training.micro_batch})")
    else:
        state_bytes = sum(STATE_BYTES_PER_PARAM[training.precision]) * model.params
        gpus = math.ceil(state_bytes * (1 + training.headroom)
                         / (cluster.gpu_memory_gb * GB))
        if gpus > world:
            fixes.append(f"use at least {gpus} GPUs (the {state_bytes / GB:,.1f} GB of "
                         f"weights, gradients and optimizer state alone need that many, "
                         f"fully sharded with headroom)")
        else:
            fixes.append("use more GPUs to shard the state further")
    fixes.append(f"use GPUs with at least {need_gb:,.1f} GB")
    raise NoFit(f"no layout of {world} GPUs fits {_count(model.params)} parameters in "
                f"{cluster.gpu_memory_gb:,.1f} GB per GPU: the smallest, {smallest.layout}, "
                f"needs {need_gb:,.1f} GB (incl. {training.headroom:.0%} headroom), "
                f"largest part {part} {part_bytes / GB:,.1f} GB. To fit: "
                + "; or ".join(fixes))


def to_json(cands: list[Candidate]) -> list[dict]:
    """The candidates as JSON-ready dicts, in rank order (``rank`` starts at 1); memory in
    bytes, ``layout`` in ``KEEL_MESH`` form plus each axis."""
    out = []
    for rank, c in enumerate(cands, 1):
        mem = c.memory
        out.append({
            "rank": rank,
            "layout": str(c.layout),
            **{axis: getattr(c.layout, axis) for axis in AXES},
            "zero_stage": c.zero_stage,
            "memory": {
                "weights_bytes": mem.weights_bytes,
                "gradients_bytes": mem.gradients_bytes,
                "optimizer_bytes": mem.optimizer_bytes,
                "activations_bytes": mem.activations_bytes,
                "buffers_bytes": mem.buffers_bytes,
                "headroom_bytes": mem.headroom_bytes,
                "total_bytes": mem.total_bytes,
            },
            "comm_bytes_per_step": c.comm_bytes_per_step,
            "bubble": c.bubble,
            "fits": c.fits,
            "reason": c.reason,
        })
    return out


_COLUMNS = ("rank", "layout", "ZeRO", "weights", "grads", "optim", "activ", "buffers",
            "headroom", "total", "comm GB/step", "bubble %", "fits", "reason")


def table(cands: list[Candidate]) -> str:
    """A fixed-width table of the candidates in rank order: memory per GPU and
    communication per step in GB (1e9 bytes, one decimal), bubble in percent."""
    rows = []
    for rank, c in enumerate(cands, 1):
        mem = c.memory
        gb = [f"{x / GB:,.1f}" for x in (mem.weights_bytes, mem.gradients_bytes,
                                         mem.optimizer_bytes, mem.activations_bytes,
                                         mem.buffers_bytes, mem.headroom_bytes,
                                         mem.total_bytes, c.comm_bytes_per_step)]
        rows.append((str(rank), str(c.layout), str(c.zero_stage), *gb,
                     f"{c.bubble * 100:.1f}", "yes" if c.fits else "no", c.reason))
    widths = [max(len(row[i]) for row in [_COLUMNS, *rows]) for i in range(len(_COLUMNS) - 1)]
    lines = []
    for row in [_COLUMNS, *rows]:
        cells = [cell.ljust(w) if i in (1, 12) else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]))
    if not rows:
        lines.append("(no valid layout)")
    return "\n".join(lines)
