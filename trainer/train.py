"""The reference trainer: a small Llama-style decoder on synthetic tokens, sharded with
FSDP2 over all ranks, checkpointed with DCP, resumable on any world size.

Launch it with torchrun (or let a Keel agent do so)::

    torchrun --standalone --nproc-per-node 2 -m trainer.train --steps 40 --checkpoint-dir /tmp/ckpt

Rank 0 prints one line per step to stdout, ``step=N loss=L tokens/s=T``: N counts
optimizer steps from 1, L is the mean loss over ranks in nats, T the global tokens per
second of that step. Other messages go to stderr.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from trainer import checkpoint, runtime as keel_runtime
from trainer.checkpoint import TrainerState
from trainer.data import SyntheticTokens, rank_samples
from trainer.model import ModelConfig, Transformer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train",
        description="Keel's reference FSDP2 trainer on a synthetic Markov-chain token stream.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--steps", type=int, required=True, help="target number of optimizer steps in total, counting those before a resume"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="checkpoint at every multiple of this many steps (and at the last step)"
    )
    parser.add_argument(
        "--global-batch", type=int, default=16, help="samples per step over all ranks; must divide by the data-parallel size"
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (a resume keeps the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("KEEL_CHECKPOINT_DIR") or None,
        help="where checkpoints live; default $KEEL_CHECKPOINT_DIR, else no checkpoints",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "checkpoint_every", "global_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % world_size != 0:
        parser.error(
            f"--global-batch {args.global_batch} does not divide by the {world_size} data-parallel ranks; "
            f"use a multiple of {world_size}"
        )
    return args


def shard(model: Transformer, mesh) -> None:
    """FSDP2: each block is one unit (gathered just in time, freed after use), the root
    holds the embedding, final norm and head."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_step(
    model: Transformer, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """One optimizer step on this rank's micro-batch; returns its mean loss in nats
    (detached, on ``device``)."""
    logits = model(inputs.to(device))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The mean of every rank's ``loss``; each rank has the same number of samples, so
    this is the loss over the global batch."""
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def train(args: argparse.Namespace, rt: keel_runtime.Runtime, device: torch.device) -> None:
    """Trains until ``args.steps`` optimizer steps are done, starting fresh or from the
    checkpoint ``checkpoint.restore_point`` names."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    config = ModelConfig(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, max_seq_len=args.seq_len
    )
    model = Transformer(config, seed=args.seed).to(device)
    shard(model, init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = SyntheticTokens(args.vocab, args.seq_len, args.seed)

    state = TrainerState(step=0, samples=0, lr=args.lr, rng_state=torch.get_rng_state())
    if rank == 0:
        for name in checkpoint.discard_staging(args.checkpoint_dir):
            rt.log(f"removed {name}, left by a rank that died while saving")
    restore = checkpoint.restore_point(args.checkpoint_dir, rt.restore_from, managed=bool(rt.job))
    if restore:
        state = checkpoint.load(restore, model, optimizer)
        torch.set_rng_state(state.rng_state)
        if rank == 0:
            rt.log(f"resumed from {restore} at step={state.step} samples={state.samples} on {world_size} ranks")
            if state.lr != args.lr:
                rt.log(f"keeping the checkpoint's lr={state.lr:g}, not --lr {args.lr:g}")
    elif rank == 0:
        rt.log(f"fresh start on {world_size} ranks")

    step, samples = state.step, state.samples
    while step < args.steps:
        rt.inject_faults(step + 1)
        started = time.perf_counter()
        first, count = rank_samples(samples, args.global_batch, rank, world_size)
        loss = train_step(model, optimizer, *data.batch(first, count), device)
        # Measured before the loss all-reduce, where every rank waits for the slowest,
        # this is the rank's own step time: what the straggler detector compares.
        busy_s = time.perf_counter() - started
        busy_s += rt.after_step(busy_s)
        mean_loss = mean_over_ranks(loss)
        step, samples = step + 1, samples + args.global_batch
        rt.report_step(step, mean_loss, count * args.seq_len, busy_s)
        if rank == 0:
            tokens_per_s = args.global_batch * args.seq_len / (time.perf_counter() - started)
            print(f"step={step} loss={mean_loss:.6f} tokens/s={tokens_per_s:.0f}", flush=True)
        if args.checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
            saved = TrainerState(step, samples, optimizer.param_groups[0]["lr"], torch.get_rng_state())
            checkpoint.save(args.checkpoint_dir, model, optimizer, saved, rt)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rt = keel_runtime.init()
    # The flag may name a directory Keel did not; one-shot fault markers live there too.
    rt.checkpoint_dir = args.checkpoint_dir
    if any(size != 1 for name, size in rt.mesh.items() if name != "dp_shard"):
        raise ValueError(
            f"KEEL_MESH={os.environ.get('KEEL_MESH')!r}: the reference trainer runs dp_shard only; "
            f"give dp_shard={rt.world_size}"
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", rt.local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        train(args, rt, device)
    except BaseException as error:
        # The traceback keeps train()'s frames alive, and with them the model; drop
        # their locals (the traceback text survives) so shutdown can free it.
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        rt.close()
        shut_down_process_group()
    return 0


def shut_down_process_group() -> None:
    """Frees the process group while the interpreter is fully alive. FSDP2 modules,
    their DTensors and the device mesh hold it in reference cycles; left to the
    interpreter's final garbage collection, gloo's worker threads release tensors when
    they can no longer take the GIL, and the rank dies with SIGABRT after a clean run
    (the failure pytorch/pytorch#179291 describes)."""
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
