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

Rooms: ``shapes`` (what it is told), ``memory`` (the memory and bubble model),
``ranking`` (pricing, validation, ranking), ``report`` (table and JSON), ``sizing``
(the next generation's world size and layout for a job spec).
"""

from __future__ import annotations

from common.layout import Layout, LayoutError
from orchestrator.planner.memory import (
    activation_bytes_per_layer,
    pipeline_bubble,
    zero_memory_per_gpu_bytes,
)
from orchestrator.planner.ranking import (
    Candidate,
    MemoryBreakdown,
    NoFit,
    best,
    candidates,
    validate_layout,
)
from orchestrator.planner.report import table, to_json
from orchestrator.planner.shapes import GB, Cluster, ModelShape, Training

__all__ = [
    "GB",
    "Candidate",
    "Cluster",
    "Layout",
    "LayoutError",
    "MemoryBreakdown",
    "ModelShape",
    "NoFit",
    "Training",
    "activation_bytes_per_layer",
    "best",
    "candidates",
    "pipeline_bubble",
    "table",
    "to_json",
    "validate_layout",
    "zero_memory_per_gpu_bytes",
]
