"""Gradient clipping by the norm of the whole model's gradient, whatever the layout.

Every gradient is a DTensor (FSDP2 makes every parameter one): sharded along some mesh
dimensions (``dp_shard``, ``tp``), replicated along others (``dp_replicate``; ``tp``
for the norms' weights). Each element of the whole model's gradient is counted once
if every rank adds the squares of its local shard only where it is the first of its
replicas, and the sums are added over all ranks: the sharded dimensions split the
tensor, the pipeline stages split the model. One all-reduce, where torchtitan's
``clip_grad_norm_`` reduces DTensor norms per mesh dimension and then over the pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def _owned_square_sum(grad: DTensor) -> torch.Tensor:
    """The sum of squares of ``grad``'s local shard, or 0 where this rank is not the
    first replica along some replicated mesh dimension."""
    coordinate = grad.device_mesh.get_coordinate()
    for placement, index in zip(grad.placements, coordinate):
        if isinstance(placement, Replicate) and index != 0:
            return torch.zeros((), dtype=torch.float32, device=grad.device)
    return torch.linalg.vector_norm(grad.to_local(), dtype=torch.float32) ** 2


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Scales every gradient of ``parameters`` (all of this rank's parameters, DTensors,
    of all its pipeline stages) so that the L2 norm of the whole model's gradient is
    at most ``max_norm``; returns that norm before clipping. Collective over all ranks."""
    parameters = [p for p in parameters if p.grad is not None]
    if not all(isinstance(p.grad, DTensor) for p in parameters):
        raise TypeError(
            "clip_grad_norm_ needs DTensor gradients; apply FSDP2 (trainer.parallelize) first"
        )
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in parameters:
        total += _owned_square_sum(p.grad)
    dist.all_reduce(total)
    total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total.item()
