"""The reference trainer: a small Llama-style decoder on synthetic tokens, in any
composite-parallel layout (FSDP2/HSDP × tensor × pipeline parallel), checkpointed
asynchronously with DCP, resumable on any world size and layout.

Launch it with torchrun (or let a Keel agent do so)::

    torchrun --standalone --nproc-per-node 4 -m trainer.train --steps 40 --layout dp_shard=2,tp=2 \\
        --checkpoint-dir /tmp/ckpt

The layout comes from ``--layout``, else ``KEEL_MESH``, else ``dp_shard`` over all
ranks. Every message is a structured log line on stderr (``trainer.runtime``; JSON
unless stderr is a terminal). Rank 0 logs a ``step`` event per step with fields
``step`` (optimizer steps, from 1), ``loss`` (the mean loss over the global batch in
nats, the same on every rank) and ``tokens_per_s`` (the global tokens per second of
that step).

A generation starts with a barrier that names missing ranks and a preflight sweep of
the collectives (``trainer.preflight``); collectives get ``--startup-timeout-s`` until
the first step is done and ``--collective-timeout-s`` after it (``trainer.watchdog``).
Each step is reported to the Keel agent with its phases; when the agent asks for a
checkpoint, every rank saves after the same step.

Under a Keel agent the trainer restarts in place (``--restart-in-place``, the default):
when a generation ends under a rank (a peer died and a collective failed, or the agent
asks every rank to leave after the same step), the rank waits for its async save to
settle, destroys its process group and model, and becomes the next generation's rank
in the same process (``trainer.runtime.Runtime.next_generation``): a new process group,
the model built and sharded for the new layout, the committed checkpoint restored. Its
own errors still end the process.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.multiprocessing.errors import record

from trainer import (
    checkpoint,
    checkpoint_dir,
    fence,
    lineage,
    memory_tier,
    mesh,
    optim,
    parallelize,
    pipeline,
    preflight,
    storage_faults,
    watchdog,
)
from trainer import (
    restore as restore_from,
)
from trainer import (
    runtime as keel_runtime,
)
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.data import SyntheticTokens, rank_samples
from trainer.memory_tier import MemoryTier
from trainer.mesh import BatchPlan, Layout
from trainer.model import ModelConfig, Transformer
from trainer.options import parse_args
from trainer.phases import PhaseTimer
from trainer.step import TrainStep

__all__ = [
    "Setup",
    "exchange",
    "exchange_step",
    "main",
    "parse_args",
    "run_generation",
    "setup",
    "train",
]

# How long a failed rank waits for its checkpoint saves to end before it may restart in
# place; past it the rank exits instead.
SETTLE_S = 10.0


@dataclass
class Setup:
    """Everything built for one run: the ``layout`` and its ``device_mesh``, this
    rank's model ``parts`` (the whole model, or its pipeline stages), the
    ``optimizers`` (one per part, with their learning-rate schedules), and ``step``,
    which runs one optimizer step."""

    layout: Layout
    device_mesh: DeviceMesh
    parts: list[nn.Module]
    optimizers: optim.Optimizers
    step: TrainStep


def resolve_layout(args: argparse.Namespace, rt: keel_runtime.Runtime) -> Layout:
    """``--layout`` if given, else the runtime's (``KEEL_MESH`` or all ``dp_shard``)."""
    if args.layout:
        return Layout.parse(args.layout, rt.world_size, source="--layout")
    return Layout(**rt.mesh)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab=args.vocab,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        max_seq_len=args.seq_len,
    )


def setup(args: argparse.Namespace, layout: Layout, device: torch.device) -> Setup:
    """Validates ``layout`` for ``args`` (ValueError before anything is built), then
    builds the mesh, the model parts, parallelized, and the optimizer. Collective."""
    config = model_config(args)
    plan = BatchPlan.for_layout(
        layout,
        global_batch=args.global_batch,
        grad_accum=args.grad_accum,
        microbatches=args.microbatches,
        pp_schedule=args.pp_schedule,
        virtual_stages=args.virtual_stages,
    )
    mesh.validate(layout, config, plan, dist.get_world_size())
    device_mesh = mesh.build(layout, device.type)
    # The whole model first, on every rank: its weights are a function of the seed, so
    # every layout starts from the same ones.
    model = Transformer(config, seed=args.seed)
    stages = None
    if layout.pp > 1:
        num_stages = layout.pp * plan.virtual_stages
        owned = pipeline.stage_layers(config.layers, num_stages)
        indices = pipeline.local_stage_indices(
            device_mesh.get_local_rank("pp"), layout.pp, plan.virtual_stages
        )
        parts = [
            pipeline.stage_module(model, owned[index], index == 0, index == num_stages - 1)
            for index in indices
        ]
        stages = pipeline.Stages(
            tuple(indices),
            num_stages,
            plan.pp_schedule,
            plan.microbatches,
            device_mesh.get_group("pp"),
        )
    else:
        parts = [model]
    reshard_after_forward = (
        args.reshard_after_forward if args.reshard_after_forward is not None else layout.pp == 1
    )
    for part in parts:
        part.to(device)
        parallelize.parallelize(
            part,
            tp_mesh=device_mesh["tp"] if layout.tp > 1 else None,
            dp_mesh=mesh.dp_mesh(device_mesh, layout),
            device_type=device.type,
            activation_checkpointing=args.activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
        )
    optimizers = optim.Optimizers(
        parts,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        total_steps=args.steps,
        schedule=args.lr_schedule,
    )
    step = TrainStep(
        parts,
        optimizers,
        grad_accum=args.grad_accum,
        clip_grad=args.clip_grad,
        device=device,
        stages=stages,
    )
    return Setup(layout, device_mesh, parts, optimizers, step)


@dataclass(frozen=True)
class Exchanged:
    """What every rank knows after a step's exchange: the ``mean_loss`` over the
    global batch, the ``(first, count)`` samples each rank ``consumed``, whether any
    rank's agent asked for a checkpoint (``checkpoint_requested``), and whether any
    was asked to leave the generation (``leave_requested``)."""

    mean_loss: float
    consumed: list[tuple[int, int]]
    checkpoint_requested: bool
    leave_requested: bool = False


def exchange_step(
    loss: float | None,
    first: int,
    count: int,
    represents: bool,
    checkpoint_requested: bool,
    device: torch.device,
    leave_requested: bool = False,
) -> Exchanged:
    """One all-gather per step for what every rank needs to know: the mean loss over
    the global batch (the mean over ranks that hold a loss — all of them, or the last
    pipeline stage's; each covers the same number of samples), the ``(first, count)``
    samples each data-parallel rank consumed (``represents``: this rank speaks for its
    data-parallel rank, which its tensor and pipeline peers share), and whether any
    rank was asked for a checkpoint (``checkpoint_requested`` on this rank), so that
    all save after the same step, or to leave the generation (``leave_requested``), so
    that all leave after the same step."""
    mine = torch.tensor(
        [
            loss or 0.0,
            1.0 if loss is not None else 0.0,
            first,
            count if represents else 0,
            float(checkpoint_requested),
            float(leave_requested),
        ],
        dtype=torch.float64,
        device=device,
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()
    mean_loss = (table[:, 0].sum() / table[:, 1].sum()).item()
    # float64 holds sample indices exactly up to 2**53.
    consumed = [(int(first), int(count)) for _, _, first, count, _, _ in table.tolist()]
    return Exchanged(mean_loss, consumed, bool(table[:, 4].any()), bool(table[:, 5].any()))


def exchange(
    loss: float | None, first: int, count: int, represents: bool, device: torch.device
) -> tuple[float, list[tuple[int, int]]]:
    """``exchange_step`` for loops without checkpoint requests: the mean loss and the
    consumed samples."""
    shared = exchange_step(loss, first, count, represents, False, device)
    return shared.mean_loss, shared.consumed


def checkpoint_due(step: int, args: argparse.Namespace, requested: bool) -> bool:
    """Whether a checkpoint follows step ``step``: at every multiple of
    ``--checkpoint-every``, at the last step, and when an agent asked for one."""
    return step % args.checkpoint_every == 0 or step == args.steps or requested


def run_preflight(args: argparse.Namespace, rt: keel_runtime.Runtime, device: torch.device) -> None:
    """The collective sweep before the first step (unless switched off, or on one
    rank): each rank reports its figures to its agent, rank 0 logs a summary."""
    if not args.preflight or dist.get_world_size() == 1:
        return
    sweep = preflight.run(args.preflight_sizes_mb, args.preflight_budget_s, device)
    rt.report_preflight(sweep.results, sweep.wall_s)
    if dist.get_rank() == 0:
        rt.log(preflight.summary(sweep, dist.get_world_size(), args.preflight_budget_s))


@dataclass
class Background:
    """What a generation of the trainer runs besides its loop: the checkpointer and the
    memory tier, whose saves must end before the process may live on into another
    generation."""

    checkpointer: Checkpointer | None = None
    memory: MemoryTier | None = None

    def settle(self, rt: keel_runtime.Runtime) -> bool:
        settled = True
        if self.checkpointer is not None and not self.checkpointer.settle(SETTLE_S):
            rt.log(
                f"a checkpoint save of generation {rt.generation} did not end within {SETTLE_S:g} s"
            )
            settled = False
        if self.memory is not None and not self.memory.settle(SETTLE_S):
            rt.log(
                f"a memory snapshot of generation {rt.generation} did not end within {SETTLE_S:g} s"
            )
            settled = False
        return settled


def train(
    args: argparse.Namespace,
    rt: keel_runtime.Runtime,
    device: torch.device,
    current: Background | None = None,
) -> Setup:
    """Trains until ``args.steps`` optimizer steps are done, starting fresh or from the
    checkpoint ``trainer.restore.choose`` names, and returns what it trained (with
    the last checkpoint committed). ``current`` is told of the checkpointer and the
    memory tier."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    run_preflight(args, rt, device)
    torch.manual_seed(args.seed)
    layout = resolve_layout(args, rt)
    run = setup(args, layout, device)
    data = SyntheticTokens(args.vocab, args.seq_len, args.seed)

    state = TrainerState(
        step=0,
        samples=0,
        scheduler=run.optimizers.scheduler_state(),
        rng_state=torch.get_rng_state(),
    )
    if rank == 0:
        lineage.refuse_foreign(args.checkpoint_dir, rt)
        first_claim = lineage.claimant(rt, lineage.descent(None, rt))
        try:
            removed = checkpoint_dir.discard_staging(
                args.checkpoint_dir,
                rt.generation,
                first_claim,
                fence_timeout_s=rt.fence_timeout_s,
                node=rt.node,
            )
        except fence.FenceTimeout as stalled:
            storage_faults.report_fence_timeout(rt, 0, stalled)
            raise
        for name in removed:
            rt.log(f"removed {name}, left by a rank that died while saving")
    restoring = time.perf_counter()
    memory_on = args.memory_checkpoint_every > 0 and memory_tier.everywhere(rt)
    target = _LoadTarget(run, state)
    restored = restore_from.choose(args.checkpoint_dir, rt, memory=memory_on, reads=target.reads)
    chain = lineage.descent(restored, rt)
    if rank == 0 and args.checkpoint_dir and restored and restored.lineage:
        # The fence names the lineage the restored checkpoint continues.
        fence.claim(
            args.checkpoint_dir,
            rt.generation,
            lineage.claimant(rt, chain),
            timeout_s=rt.fence_timeout_s,
            node=rt.node,
        )
    restore = restored.path if restored else None
    if restore:
        reader = memory_tier.SnapshotReader(restore) if restored.memory else None
        state = checkpoint.load(
            restore, run.parts, run.optimizers.optimizers, state, reader, target.built
        )
        run.optimizers.load_scheduler_state(state.scheduler)
        torch.set_rng_state(state.rng_state)
        if rank == 0:
            rt.log(
                f"resumed from {restore} at step={state.step} samples={state.samples} "
                f"on {world_size} ranks as {layout}"
            )
            if restored.resumed:
                rt.log(
                    f"started lineage {'→'.join(j[:8] for j in chain)} from {restore}; "
                    f"it is read, never changed: this job writes in {args.checkpoint_dir}"
                )
            if run.optimizers.peak_lr != args.lr:
                rt.log(
                    f"keeping the checkpoint's lr={run.optimizers.peak_lr:g}, not --lr {args.lr:g}"
                )
    elif rank == 0:
        rt.log(f"fresh start on {world_size} ranks as {layout}")
    # Choosing (verifying) and loading the checkpoint; reported with the first step.
    restore_s = time.perf_counter() - restoring if restore else 0.0
    checkpointer = None
    if args.checkpoint_dir:
        checkpointer = Checkpointer(
            args.checkpoint_dir,
            rt,
            use_async=args.async_checkpoint,
            keep=args.keep_checkpoints,
            restored_from=restore,
            lineage=chain,
        )

    memory = (
        MemoryTier(
            rt,
            every=args.memory_checkpoint_every,
            overhead_max=args.memory_overhead_max,
            lineage=chain,
        )
        if memory_on
        else None
    )

    # Before each optimizer step: the state it changes is no longer being copied.
    waits = [part.before_update for part in (checkpointer, memory) if part is not None]
    if waits:
        run.step.before_update = waits[0] if len(waits) == 1 else _in_turn(*waits)
    if current is not None:
        current.checkpointer, current.memory = checkpointer, memory
    _loop(args, rt, device, run, data, state, checkpointer, restore_s, memory)
    if memory:
        memory.close()
    if checkpointer:
        checkpointer.wait()
    return run


class _LoadTarget:
    """The state a checkpoint is loaded into (``checkpoint.load_target``) over ``run``'s
    parts, built at most once: for the files of a memory snapshot that restoring it
    reads on this rank (``reads``, given its node's metadata: ``memory_tier.files_read``),
    then filled by the load (``built``: None until ``reads`` built it)."""

    def __init__(self, run, state: TrainerState) -> None:
        self.run, self.state = run, state
        self.built: tuple[dict, list[tuple[dict, dict]]] | None = None

    def reads(self, metadata: Metadata) -> set[str]:
        if self.built is None:
            self.built = checkpoint.load_target(
                self.run.parts, self.run.optimizers.optimizers, self.state
            )
        return memory_tier.files_read(metadata, self.built[0])


def _in_turn(*calls: Callable[[], None]) -> Callable[[], None]:
    """One call that makes ``calls``, in order."""

    def each() -> None:
        for call in calls:
            call()

    return each


def _loop(
    args: argparse.Namespace,
    rt: keel_runtime.Runtime,
    device: torch.device,
    run: Setup,
    data: SyntheticTokens,
    state: TrainerState,
    checkpointer: Checkpointer | None,
    restore_s: float,
    memory: MemoryTier | None = None,
) -> None:
    """The steps from ``state`` to ``args.steps``, checkpointed as asked and
    snapshotted into ``memory``; raises ``GenerationEnded`` after a step in which any
    rank was asked to leave."""
    rank = dist.get_rank()
    layout = run.layout
    dp_rank, represents = layout.dp_rank(rank), layout.speaks_for_its_data(rank)
    timer = PhaseTimer(device)
    first_step = state.step + 1
    step, samples, ledger = state.step, state.samples, state.ledger
    while step < args.steps:
        if checkpointer:
            checkpointer.poll()
        rt.inject_faults(step + 1)
        started = time.perf_counter()
        timer.start()
        first, count = rank_samples(samples, args.global_batch, dp_rank, layout.dp_size)
        inputs, targets = data.batch(first, count)
        timer.lap("data_s")
        loss = run.step(inputs, targets, timer)
        # Measured before the exchange's all-gather, where every rank waits for the
        # slowest, this is the rank's own step time: what the straggler detector compares.
        busy_s = time.perf_counter() - started
        # Checkpointing's waits, not the step's.
        if memory:
            busy_s -= memory.take_update_wait_s()
        if checkpointer:
            busy_s -= checkpointer.take_update_wait_s()
        busy_s += rt.after_step(busy_s)
        shared = exchange_step(
            loss,
            first,
            count,
            represents,
            rt.take_checkpoint_request(),
            device,
            rt.leave_requested(),
        )
        step, samples = step + 1, samples + args.global_batch
        ledger.record(step, shared.consumed)
        if step == first_step:
            watchdog.set_collective_timeout(
                args.collective_timeout_s,
                [run.device_mesh.get_group(name) for name in mesh.MESH_DIM_NAMES],
            )
        save = checkpointer is not None and checkpoint_due(step, args, shared.checkpoint_requested)
        snapshot = memory is not None and memory.due(step, args.steps)
        blocked_s = checkpointer.take_blocked_s() if checkpointer else 0.0
        blocked_s += memory.take_blocked_s() if memory else 0.0
        # Sent before the save starts, so the agent's hang detector gives it the
        # checkpoint's budget; the time it blocks is in the next step's report.
        rt.report_step(
            step,
            shared.mean_loss,
            count * args.seq_len,
            busy_s,
            **timer.seconds(),
            checkpointing=save or snapshot,
            checkpoint_s=blocked_s,
            restore_s=restore_s if step == first_step else 0.0,
        )
        if rank == 0:
            tokens_per_s = args.global_batch * args.seq_len / (time.perf_counter() - started)
            rt.log("step", step=step, loss=shared.mean_loss, tokens_per_s=round(tokens_per_s))
            if shared.checkpoint_requested:
                rt.log(
                    f"the agent asked for a checkpoint: saving after step {step}"
                    if checkpointer
                    else "the agent asked for a checkpoint, but there is no --checkpoint-dir: "
                    "not saving"
                )
        if save or snapshot:
            saved = TrainerState(
                step, samples, run.optimizers.scheduler_state(), torch.get_rng_state(), ledger
            )
            building = time.perf_counter()
            whole = checkpoint.state_dict(run.parts, run.optimizers.optimizers, saved)
            if snapshot:
                memory.save(step, samples, whole, built_s=time.perf_counter() - building)
            if save:
                checkpointer.save(step, samples, whole, ledger, args.global_batch)
                if memory:
                    memory.set_period_apart()
        if shared.leave_requested:
            raise keel_runtime.GenerationEnded(
                f"the agent asked to leave generation {rt.generation} after step {step}"
            )


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rt = keel_runtime.init(restart_in_place=args.restart_in_place)
    try:
        while not run_generation(args, rt):
            pass
    finally:
        rt.close()
    return 0


def run_generation(args: argparse.Namespace, rt: keel_runtime.Runtime) -> bool:
    """One generation of this rank: True when training is done, False when this
    process has become the next generation's rank (restart in place). Raises what
    ended it otherwise."""
    # The flag may name a directory Keel did not; one-shot fault markers live there too.
    rt.checkpoint_dir = args.checkpoint_dir
    startup_timeout = timedelta(seconds=args.startup_timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", rt.local_rank)
        torch.cuda.set_device(device)
        watchdog.arm_nccl(args.checkpoint_dir)
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device, timeout=startup_timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=startup_timeout)
    current = Background()
    try:
        # monitored_barrier is gloo's; a GPU job's default group is NCCL's.
        watchdog.start_barrier(
            args.startup_timeout_s, None if device.type == "cpu" else dist.new_group(backend="gloo")
        )
        train(args, rt, device, current)
        return True
    except BaseException as error:
        # The traceback keeps train()'s frames alive, and with them the model; drop
        # their locals (the traceback text survives) so shutdown can free it.
        traceback.clear_frames(error.__traceback__)

        def teardown() -> bool:
            settled = current.settle(rt)
            current.checkpointer = current.memory = None
            shut_down_process_group()
            return settled

        if rt.next_generation(error, teardown):
            return False
        raise
    finally:
        if dist.is_initialized():
            shut_down_process_group()


def shut_down_process_group() -> None:
    """Frees the process group while the interpreter is fully alive. FSDP2 modules,
    their DTensors and the device mesh hold it in reference cycles; left to the
    interpreter's final garbage collection, gloo's worker threads release tensors when
    they can no longer take the GIL, and the rank dies with SIGABRT after a clean run
    (the failure pytorch/pytorch#179291 describes)."""
    gc.collect()
    dist.destroy_process_group()


def exit_without_finalizing(code: int) -> NoReturn:
    """End the process with ``code`` once its work is durable and the process group is
    shut down, skipping the interpreter's finalization. Even then a gloo worker thread
    can still release a tensor there, and a rank that finished cleanly dies with
    SIGABRT ("terminate called without an active exception"; seen once in a full test
    run here): a supervisor would count that as a failure and restart the job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # @record turns the SystemExit(0) of --help into a return of None.
    code = main()
    exit_without_finalizing(0 if code is None else code)
