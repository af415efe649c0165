"""Tensor parallelism, activation checkpointing and FSDP2, applied in that order to one
model part (the whole model, or one pipeline stage), as torchtitan does.

Tensor parallelism is Megatron's split with sequence parallelism between the splits:
attention's ``wq``/``wk``/``wv`` and the MLP's ``w1``/``w3`` are split by output columns
(each rank holds ``heads / tp`` whole heads), ``wo`` and ``w2`` by input rows, and the
residual stream between them — where the RMSNorms run — is split along the sequence.
The embedding is split by vocabulary rows, the head by vocabulary columns with its
logits gathered, so the loss is the plain cross-entropy of the unsplit model.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.model import Transformer

# The head's gathered logits come back as a view, which FSDP2 warns about because an
# in-place op on it would skip its backward hook; the loss reads them out of place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Splits ``model``'s weights over ``tp_mesh`` (see the module docstring)."""
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1)
        )
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
        root_plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    block_plan = {
        "attention_norm": SequenceParallel(),
        # x arrives split along the sequence; attention needs all of it. The rotary
        # tables are plain tensors, the same on every rank.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "mlp.w1": ColwiseParallel(),
        "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def apply_activation_checkpointing(model: Transformer) -> None:
    """Recomputes each block's activations in the backward pass instead of keeping
    them. The wrapper's name is stripped from checkpoint keys by DCP's state-dict
    helpers, so checkpoints do not depend on this setting."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block)


def apply_fsdp(
    model: Transformer, dp_mesh: DeviceMesh, device_type: str, reshard_after_forward: bool
) -> None:
    """FSDP2 over ``dp_mesh`` (1-D: ZeRO-3; 2-D ``(dp_replicate, dp_shard)``: HSDP):
    each block is one unit, gathered just in time; the root unit holds whatever else the
    part owns. On GPU, parameters compute in bf16 and gradients reduce in fp32; on CPU
    everything stays fp32."""
    if device_type == "cuda":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(
            block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    # The root's parameters are needed again at once by the backward pass.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)


def parallelize(
    model: Transformer,
    *,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh,
    device_type: str,
    activation_checkpointing: bool,
    reshard_after_forward: bool,
) -> nn.Module:
    """Applies tensor parallelism (when ``tp_mesh`` is given), activation checkpointing
    (when asked) and FSDP2 to ``model`` in place and returns it."""
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, dp_mesh, device_type, reshard_after_forward)
    return model
