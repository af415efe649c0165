"""Whether a job's shape fits its parallel layout (``pp × dp_replicate × dp_shard × tp``;
the grammar and rank order are ``common.layout``'s), and the device mesh itself.

Ranks are laid out with ``pp`` outermost and ``tp`` innermost, so the ``tp`` ranks of a
group are consecutive: with torchrun's node-major rank order they share a node, which
is where tensor parallelism's per-layer collectives belong.

``validate`` is a pure function of the layout, the model and the batch plan; it runs
before anything is built and says how to fix what does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.model import ModelConfig
from trainer.runtime import MESH_DIM_NAMES, Layout

__all__ = ["MESH_DIM_NAMES", "PP_SCHEDULES", "BatchPlan", "Layout", "build", "dp_mesh", "validate"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class BatchPlan:
    """How a step's samples are cut up. ``global_batch``: samples per optimizer step
    over all ranks; ``grad_accum``: forward/backward passes per optimizer step;
    ``microbatches``: pipeline micro-batches per pass (1 without pipeline
    parallelism); ``pp_schedule`` one of ``PP_SCHEDULES``; ``virtual_stages``: pipeline
    stages per rank (more than 1 only for ``interleaved_1f1b``)."""

    global_batch: int
    grad_accum: int = 1
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1

    @classmethod
    def for_layout(
        cls,
        layout: Layout,
        *,
        global_batch: int,
        grad_accum: int,
        microbatches: int | None,
        pp_schedule: str,
        virtual_stages: int,
    ) -> BatchPlan:
        """The plan the command line asks for, under ``layout``: the pipeline settings
        apply only with ``pp`` > 1, so the same command line runs under any layout the
        controller picks; ``microbatches`` None means one per pipeline stage rank."""
        if layout.pp == 1:
            return cls(global_batch=global_batch, grad_accum=grad_accum)
        return cls(
            global_batch=global_batch,
            grad_accum=grad_accum,
            microbatches=microbatches or layout.pp,
            pp_schedule=pp_schedule,
            virtual_stages=virtual_stages if pp_schedule == "interleaved_1f1b" else 1,
        )


def validate(layout: Layout, config: ModelConfig, plan: BatchPlan, world_size: int) -> None:
    """Raises ValueError, saying how to fix it, if the job cannot run under ``layout``
    on ``world_size`` ranks. Pure."""
    if layout.world_size != world_size:
        raise ValueError(
            f"layout {layout} spans {layout.world_size} ranks but the world size is {world_size}; "
            f"make dp_replicate × dp_shard × tp × pp equal {world_size}"
        )
    if config.heads % layout.tp:
        raise ValueError(
            f"{config.heads} attention heads do not split over tp={layout.tp}; "
            f"choose tp dividing {config.heads} or a head count that is a multiple of {layout.tp}"
        )
    for what, size in (("ffn hidden width", config.hidden_dim), ("vocab", config.vocab)):
        if size % layout.tp:
            raise ValueError(
                f"{what} {size} does not split over tp={layout.tp}; choose tp dividing {size}"
            )
    if config.max_seq_len % layout.tp:
        raise ValueError(
            f"sequence parallelism splits the {config.max_seq_len}-token sequence "
            f"over tp={layout.tp}; "
            f"use a sequence length that is a multiple of {layout.tp}"
        )
    if plan.pp_schedule not in PP_SCHEDULES:
        raise ValueError(
            f"pipeline schedule {plan.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}"
        )
    if plan.grad_accum < 1 or plan.microbatches < 1 or plan.virtual_stages < 1:
        raise ValueError(
            f"grad_accum {plan.grad_accum}, microbatches {plan.microbatches} and virtual stages "
            f"{plan.virtual_stages} must each be at least 1"
        )
    stages = layout.pp * plan.virtual_stages
    if stages > config.layers:
        raise ValueError(
            f"pp={layout.pp} × {plan.virtual_stages} stages per rank make {stages} pipeline "
            f"stages but the model has {config.layers} layers; use at most {config.layers} "
            "stages (lower pp or --virtual-stages, or add layers)"
        )
    if (
        layout.pp > 1
        and plan.pp_schedule in ("1f1b", "interleaved_1f1b")
        and plan.microbatches < layout.pp
    ):
        raise ValueError(
            f"{plan.pp_schedule} needs at least one micro-batch per pipeline rank: --microbatches "
            f"{plan.microbatches} < pp={layout.pp}; use --microbatches {layout.pp} or more"
        )
    if layout.pp > 1 and plan.pp_schedule == "interleaved_1f1b":
        if plan.virtual_stages < 2:
            raise ValueError(
                "interleaved_1f1b needs at least 2 stages per rank, "
                f"got --virtual-stages {plan.virtual_stages}; use 2, or --pp-schedule 1f1b"
            )
        if plan.microbatches % layout.pp:
            raise ValueError(
                f"interleaved_1f1b runs micro-batches in rounds of pp={layout.pp}: --microbatches "
                f"{plan.microbatches} is not a multiple of {layout.pp}"
            )
    split = layout.dp_size * plan.grad_accum * plan.microbatches
    if plan.global_batch % split:
        parts = f"{layout.dp_size} data-parallel ranks × {plan.grad_accum} accumulation steps"
        if layout.pp > 1:
            parts += f" × {plan.microbatches} micro-batches"
        larger = split * max(1, round(plan.global_batch / split))
        raise ValueError(
            f"global batch {plan.global_batch} does not split into {parts} = {split}; "
            f"use a multiple of {split}, e.g. --global-batch {larger}"
        )


def build(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's device mesh with dimensions named ``MESH_DIM_NAMES``. Collective."""
    return init_device_mesh(
        device_type,
        tuple(getattr(layout, name) for name in MESH_DIM_NAMES),
        mesh_dim_names=MESH_DIM_NAMES,
    )


def dp_mesh(device_mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard``, or the 2-D ``(dp_replicate, dp_shard)``
    mesh for HSDP (replicas of a sharded group)."""
    if layout.dp_replicate > 1:
        return device_mesh["dp_replicate", "dp_shard"]
    return device_mesh["dp_shard"]
