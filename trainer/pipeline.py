"""Pipeline parallelism with ``torch.distributed.pipelining``: which blocks each stage
owns, the stage modules cut from the whole model, and the schedule that runs them.

Stage ``s`` of ``S`` lives on pipeline rank ``s % pp`` (with one stage per rank for
``gpipe`` and ``1f1b``, ``S / pp`` interleaved stages per rank for
``interleaved_1f1b``). A stage module is the whole model with the blocks of other
stages deleted, so its parameter names are the whole model's: checkpoints do not
depend on the split.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer.model import Transformer

# The embedding and the final norm + head each cost about one block when balancing
# stages (the head's matmul over the vocabulary is the larger, the embedding's
# gradient scatter the smaller; at this granularity both round to one).
EMBEDDING_COST = 1
HEAD_COST = 1


@dataclass(frozen=True)
class Stages:
    """This rank's part of the pipeline: stages ``indices`` of ``num_stages``, run by
    ``schedule`` (one of ``trainer.mesh.PP_SCHEDULES``) over ``microbatches``
    micro-batches per pass, talking to the other pipeline ranks over ``group``."""

    indices: tuple[int, ...]
    num_stages: int
    schedule: str
    microbatches: int
    group: dist.ProcessGroup

    @property
    def is_first(self) -> bool:
        return 0 in self.indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.indices


def stage_layers(layers: int, stages: int) -> list[range]:
    """The blocks each of ``stages`` pipeline stages owns, in order: every stage at
    least one block, the rest placed where they raise the most expensive stage the
    least (stage 0 also pays ``EMBEDDING_COST``, the last ``HEAD_COST``). Pure."""
    if not 1 <= stages <= layers:
        raise ValueError(
            f"cannot split {layers} layers into {stages} pipeline stages; use 1 to {layers} stages"
        )
    counts = [1] * stages
    extra = [0] * stages
    extra[0] += EMBEDDING_COST
    extra[-1] += HEAD_COST
    for _ in range(layers - stages):
        cheapest = min(range(stages), key=lambda stage: (counts[stage] + extra[stage], stage))
        counts[cheapest] += 1
    owned, start = [], 0
    for count in counts:
        owned.append(range(start, start + count))
        start += count
    return owned


def local_stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs (loop order: stage ``s`` on rank
    ``s % pp``)."""
    return [pp_rank + round_index * pp for round_index in range(virtual_stages)]


def stage_module(model: Transformer, owned: range, first: bool, last: bool) -> Transformer:
    """A copy of ``model`` holding only the blocks in ``owned``, the embedding if
    ``first`` and the final norm and head if ``last``."""
    stage = copy.deepcopy(model)
    for index in list(stage.layers.keys()):
        if int(index) not in owned:
            del stage.layers[index]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def build_schedule(
    parts: list[nn.Module],
    stages: Stages,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
):
    """The pipeline schedule running ``parts`` (this rank's stage modules, in the order
    of ``stages.indices``). Gradients are not rescaled by the schedule: ``loss_fn``
    returns each micro-batch's share of the step's loss, so gradients add up to those
    of the mean."""
    # Imported here, not with the module: torch.distributed.pipelining brings in
    # torch._dynamo, a large part of every rank's start, and only pp > 1 needs it.
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pipeline_stages = [
        PipelineStage(part, index, stages.num_stages, device, group=stages.group)
        for part, index in zip(parts, stages.indices)
    ]
    if stages.schedule == "gpipe":
        return ScheduleGPipe(
            pipeline_stages[0], stages.microbatches, loss_fn=loss_fn, scale_grads=False
        )
    if stages.schedule == "1f1b":
        return Schedule1F1B(
            pipeline_stages[0], stages.microbatches, loss_fn=loss_fn, scale_grads=False
        )
    return ScheduleInterleaved1F1B(
        pipeline_stages, stages.microbatches, loss_fn=loss_fn, scale_grads=False
    )
