"""What the planner is told: the model (``ModelShape``), the cluster (``Cluster``) and
how it is trained (``Training``), each validated on construction; and the per-GPU
figures it works with. Units: bytes, FLOP/s, bytes/s; 1 GB = 1e9 bytes."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

GB = 1e9  # GPU datasheets count 10^9 bytes to the GB; so does every figure here


class Precision(str, enum.Enum):
    """The numeric format training runs in, as ``keel plan --precision`` and spec files
    spell it."""

    BF16 = "bf16"  # mixed precision
    FP32 = "fp32"


# Bytes per parameter of (weights, gradients, optimizer state) under Adam.
STATE_BYTES_PER_PARAM = {Precision.BF16: (2, 2, 12), Precision.FP32: (4, 4, 8)}
# Bytes per activation element. Korthikanti's coefficients count 16-bit activations;
# fp32 doubles them (the 1-byte dropout masks they include make that a slight overcount).
ACTIVATION_BYTES = {Precision.BF16: 2, Precision.FP32: 4}
# AdamW keeps the same two moments as Adam; other optimizers need other state figures.
OPTIMIZERS = ("adam", "adamw")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
HEADROOM_MIN, HEADROOM_MAX = 0.10, 0.20

# Nominal H100/H200-class figures. They only weigh communication against compute and the
# bubble when ranking meshes, so what matters is their ratio, not their exact values.
NOMINAL_FLOP_PER_S = 400e12  # bf16 at about 40 % of an H100's dense peak
NVLINK_BYTES_PER_S = 450e9  # per GPU and direction, inside a node
NETWORK_BYTES_PER_S = 50e9  # one 400 Gb/s NIC per GPU, between nodes


MAX_PARAMS = 1e15  # beyond any model; bounds the planner's arithmetic


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
            raise ValueError(
                f"ModelShape params={self.params!r}: give the parameter count "
                f"(at most {MAX_PARAMS:g}), e.g. params=7e9, "
                "or build it with ModelShape.from_dims(...)"
            )
        shape = {
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "vocab": self.vocab,
        }
        negative = [f"{k}={v}" for k, v in shape.items() if v < 0]
        if negative:
            raise ValueError(
                f"ModelShape {', '.join(negative)}: sizes cannot be negative; use 0 for unknown"
            )
        dims = (self.layers, self.hidden, self.heads)
        if any(dims) and not all(dims):
            raise ValueError(
                f"ModelShape layers={self.layers}, hidden={self.hidden}, "
                f"heads={self.heads}: give all three (activation memory needs "
                f"each) or none of them"
            )
        if self.heads and self.hidden % self.heads:
            raise ValueError(
                f"ModelShape hidden={self.hidden} is not divisible by "
                f"heads={self.heads}; each head is hidden/heads wide, so check "
                f"the model's config"
            )

    @property
    def has_shape(self) -> bool:
        """Whether layers, hidden and heads are known."""
        return self.layers > 0

    @classmethod
    def from_dims(
        cls, layers: int, hidden: int, heads: int, vocab: int, ffn_hidden: int | None = None
    ) -> ModelShape:
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
        return cls(params=float(params), layers=layers, hidden=hidden, heads=heads, vocab=vocab)


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
            raise ValueError(
                f"Cluster gpu_memory_gb={self.gpu_memory_gb!r}: give each GPU's "
                f"memory in GB of 1e9 bytes, e.g. 80 for an H100"
            )


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
            raise ValueError(
                f"Training global_batch={self.global_batch}: give a positive "
                f"sample count, or None to leave it unchecked"
            )
        if self.precision not in STATE_BYTES_PER_PARAM:
            raise ValueError(
                f"Training precision={self.precision!r}: use 'bf16' (mixed "
                f"precision on GPUs) or 'fp32'"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"Training optimizer={self.optimizer!r}: the planner prices "
                f"Adam's state (two fp32 moments per parameter); use 'adam' or "
                f"'adamw'"
            )
        if not HEADROOM_MIN <= self.headroom <= HEADROOM_MAX:
            raise ValueError(
                f"Training headroom={self.headroom}: give a fraction between "
                f"{HEADROOM_MIN} and {HEADROOM_MAX} of the estimate (default "
                f"0.15)"
            )
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(
                f"Training pp_schedule={self.pp_schedule!r}: use one of {', '.join(PP_SCHEDULES)}"
            )
        if self.virtual_stages < 1:
            raise ValueError(f"Training virtual_stages={self.virtual_stages}: must be at least 1")
        if self.pp_schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ValueError(
                "Training virtual_stages=1 with pp_schedule='interleaved_1f1b' "
                "is plain 1F1B: use pp_schedule='1f1b', or virtual_stages >= 2"
            )

    @property
    def virtual_stages_used(self) -> int:
        """Model chunks per pipeline rank: ``virtual_stages`` when interleaved, else 1."""
        return self.virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1
