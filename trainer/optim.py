"""The optimizer and its learning-rate schedule: AdamW over every parameter this rank
holds, with linear warm-up and then a constant or cosine-decayed learning rate."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

LR_SCHEDULES = ("constant", "cosine")
# Cosine decay ends at this fraction of the peak learning rate rather than at zero.
COSINE_FLOOR = 0.1


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The learning rate of optimizer step ``step + 1`` (``step`` steps done) as a
    fraction of the peak: linear from ``1 / (warmup_steps + 1)`` to 1 over the warm-up,
    then 1 (``constant``) or a cosine from 1 down to ``COSINE_FLOOR`` at
    ``total_steps``. Pure."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


class Optimizers:
    """One AdamW and one scheduler per model part (DCP's state-dict helpers key an
    optimizer's state by the parameter names of the one module it optimizes, and a
    rank runs several pipeline stages under interleaved schedules), driven as one.
    ``lr`` is the peak learning rate; ``lr_factor`` shapes it over the steps."""

    def __init__(
        self,
        parts: list[nn.Module],
        *,
        lr: float,
        warmup_steps: int,
        total_steps: int,
        schedule: str,
    ) -> None:
        factor = partial(
            lr_factor, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule
        )
        self.optimizers = [torch.optim.AdamW(part.parameters(), lr=lr) for part in parts]
        self.schedulers = [LambdaLR(optimizer, factor) for optimizer in self.optimizers]

    def step(self) -> None:
        """Updates the parameters, advances the learning rate and clears gradients."""
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    @property
    def peak_lr(self) -> float:
        return self.schedulers[0].base_lrs[0]

    def scheduler_state(self) -> dict:
        """The learning-rate schedule's position (the same for every part)."""
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)
