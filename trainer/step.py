"""One optimizer step on this rank's share of the global batch, under any layout:
``grad_accum`` forward/backward passes (each through the pipeline schedule when the
model is split into stages), gradient clipping by the global norm, the optimizer and
the learning-rate schedule.

Losses are scaled so that the gradients are those of the mean loss over the rank's
samples: each pass contributes ``1 / grad_accum`` of it, each pipeline micro-batch
``1 / (grad_accum · microbatches)``; FSDP then averages over the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from trainer import pipeline
from trainer.clipping import clip_grad_norm_
from trainer.optim import Optimizers
from trainer.phases import PhaseTimer


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in nats over ``[batch, seq]`` targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TrainStep:
    """Callable ``(inputs, targets) -> loss``: one optimizer step on this rank's
    samples (``[local batch, seq]`` int64 each). Returns the mean loss over them in
    nats, or None on pipeline ranks that do not hold the last stage.

    ``parts``: this rank's model parts (the whole model, or its pipeline stages in
    the order of ``stages.indices``); ``stages``: None without pipeline parallelism;
    ``clip_grad``: maximum global gradient norm, None for no clipping. After a step
    with clipping, ``grad_norm`` is the global gradient norm it measured before
    clipping. ``before_update``, if set, is called before the optimizer changes the
    state (a memory snapshot or an async checkpoint's staging copy still copying it
    waits there: ``MemoryTier``, ``Checkpointer``)."""

    def __init__(
        self,
        parts: list[nn.Module],
        optimizers: Optimizers,
        *,
        grad_accum: int,
        clip_grad: float | None,
        device: torch.device,
        stages: pipeline.Stages | None = None,
    ) -> None:
        self.parts = parts
        self.optimizers = optimizers
        self.grad_accum = grad_accum
        self.clip_grad = clip_grad
        self.device = device
        self.stages = stages
        self.grad_norm: float | None = None
        self.before_update: Callable[[], None] | None = None
        self.schedule = None
        if stages is not None:
            scale = grad_accum * stages.microbatches
            self.schedule = pipeline.build_schedule(
                parts,
                stages,
                lambda logits, targets: cross_entropy(logits, targets) / scale,
                device,
            )

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes the loss (without a pipeline, every rank)."""
        return self.stages is None or self.stages.is_last

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor, timer: PhaseTimer | None = None
    ) -> float | None:
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        loss = torch.zeros((), device=self.device)
        passes = zip(inputs.chunk(self.grad_accum), targets.chunk(self.grad_accum))
        for index, (pass_inputs, pass_targets) in enumerate(passes):
            if self.schedule is None:
                loss += self._forward_backward(
                    pass_inputs, pass_targets, last=index == self.grad_accum - 1
                )
            else:
                loss += self._pipeline_pass(pass_inputs, pass_targets)
        if timer is not None:
            timer.lap("compute_s")
        if self.clip_grad is not None:
            self.grad_norm = clip_grad_norm_(
                [p for part in self.parts for p in part.parameters()], self.clip_grad
            )
        if self.before_update is not None:
            self.before_update()
        self.optimizers.step()
        if timer is not None:
            timer.lap("optimizer_s")
        return loss.item() if self.holds_loss else None

    def _forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, last: bool
    ) -> torch.Tensor:
        (model,) = self.parts
        if isinstance(model, FSDPModule):
            # Gradients of earlier passes stay unreduced and accumulate locally; the
            # last pass reduces their sum once.
            model.set_requires_gradient_sync(last)
        loss = cross_entropy(model(inputs), targets) / self.grad_accum
        loss.backward()
        return loss.detach()

    def _pipeline_pass(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        first, last = self.stages.is_first, self.stages.is_last
        if first and last:
            self.schedule.step(inputs, target=targets, losses=losses)
        elif first:
            self.schedule.step(inputs)
        elif last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
