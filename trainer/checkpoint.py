"""Durable, reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout under the job's checkpoint directory::

    step_00000010/                 committed: complete, fsynced, atomically renamed
        .metadata                  DCP's global plan, written last by the coordinator
        __0_0.distcp  __1_0.distcp one shard file per saving rank
    .step_00000015.g3.tmp/         being written by generation 3; never loaded
    .faults/                       one-shot fault markers (see ``trainer.runtime``)

A checkpoint holds the model and optimizer (FSDP2-sharded DTensors, which DCP
reshards on load, so a job may resume on a different world size) and the trainer state:
steps done, samples consumed, learning rate and the torch RNG state.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.runtime import Runtime

METADATA_FILE = ".metadata"
_COMMITTED = re.compile(r"step_(\d{8,})")


@dataclass(frozen=True)
class TrainerState:
    """What besides the weights a resume needs. ``step``: optimizer steps done;
    ``samples``: global data position (samples consumed by all ranks); ``lr``: learning
    rate; ``rng_state``: ``torch.get_rng_state()``, the same on every rank because no
    rank draws rank-specific numbers, so one copy serves any world size."""

    step: int
    samples: int
    lr: float
    rng_state: torch.Tensor

    def to_tensors(self) -> dict[str, torch.Tensor]:
        # Plain tensors rather than Python numbers: DCP loads tensors in place, so
        # the same dict serves as the load target.
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "samples": torch.tensor(self.samples, dtype=torch.int64),
            "lr": torch.tensor(self.lr, dtype=torch.float64),
            "rng_state": self.rng_state.clone(),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> TrainerState:
        return cls(
            step=int(tensors["step"]),
            samples=int(tensors["samples"]),
            lr=float(tensors["lr"]),
            rng_state=tensors["rng_state"],
        )


def committed_path(checkpoint_dir: str, step: int) -> str:
    """The directory of step ``step``'s committed checkpoint."""
    return os.path.join(checkpoint_dir, f"step_{step:08d}")


def staging_path(checkpoint_dir: str, step: int, generation: int) -> str:
    """The directory generation ``generation`` writes step ``step`` into before commit."""
    return os.path.join(checkpoint_dir, f".step_{step:08d}.g{generation}.tmp")


def latest_committed(checkpoint_dir: str) -> str | None:
    """The highest ``step_*`` directory under ``checkpoint_dir`` that holds DCP
    metadata, or None."""
    if not os.path.isdir(checkpoint_dir):
        return None
    found = []
    for name in os.listdir(checkpoint_dir):
        match = _COMMITTED.fullmatch(name)
        path = os.path.join(checkpoint_dir, name)
        if match and os.path.isfile(os.path.join(path, METADATA_FILE)):
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def restore_point(checkpoint_dir: str | None, restore_from: str | None,
                  managed: bool) -> str | None:
    """The checkpoint this rank must load, or None for a fresh start.

    Under Keel (``managed``) the controller decides: ``restore_from`` is the last
    checkpoint it recorded, and none means a fresh start, even if an unrecorded
    ``step_*`` directory exists. Under plain torchrun, the latest committed one in
    ``checkpoint_dir`` as rank 0 sees it. Collective when it has to look: call it on
    every rank."""
    if restore_from:
        if not os.path.isfile(os.path.join(restore_from, METADATA_FILE)):
            raise FileNotFoundError(
                f"KEEL_RESTORE_FROM={restore_from} has no {METADATA_FILE}; it is not a complete "
                f"checkpoint. Point it at a committed step_* directory or unset it"
            )
        return restore_from
    if managed or not checkpoint_dir:
        return None
    # Rank 0 decides for everyone, so ranks that list the directory at slightly
    # different moments (a shared filesystem) still load the same checkpoint.
    choice = [latest_committed(checkpoint_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def discard_staging(checkpoint_dir: str | None) -> list[str]:
    """Removes every staging directory (``.step_*.tmp``) left by ranks that died while
    saving; returns what it removed. Call it on rank 0 before training starts, when no
    rank of the job can be writing (the previous generation is confirmed stopped)."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return []
    removed = []
    for name in os.listdir(checkpoint_dir):
        if name.startswith(".step_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Loads the checkpoint at ``path`` into ``model`` and ``optimizer`` (resharding to
    the current world size) and returns its trainer state. Collective."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    trainer_state = TrainerState(step=0, samples=0, lr=0.0, rng_state=torch.get_rng_state()).to_tensors()
    dcp.load({"model": model_state, "optim": optimizer_state, "trainer": trainer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    return TrainerState.from_tensors(trainer_state)


def save(
    checkpoint_dir: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    runtime: Runtime,
) -> str:
    """Writes a checkpoint of step ``state.step`` and commits it: every rank writes its
    shards into the staging directory; once DCP has gathered every rank's write results
    and written the metadata, rank 0 fsyncs the files, renames the directory to
    ``step_<08d>``, fsyncs the parent and reports the checkpoint to the agent. Returns
    the committed path. Collective; no rank returns before the commit."""
    rank = dist.get_rank()
    staging = staging_path(checkpoint_dir, state.step, runtime.generation)
    final = committed_path(checkpoint_dir, state.step)
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        # An earlier incarnation of this generation (torchrun restarts keep the
        # generation) may have died while writing this step; its shards must not mix
        # with ours.
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optimizer_state, "trainer": state.to_tensors()},
        checkpoint_id=staging,
    )

    if rank == 0:
        _fsync_tree(staging)
        if os.path.exists(final):
            # Whoever wrote it died before the controller recorded it, or the job was
            # restored from an earlier checkpoint: it was never committed. Move it to a
            # name that is never loaded before deleting, so a crash mid-delete leaves
            # no half checkpoint under a committed name.
            runtime.log(f"replacing unrecorded checkpoint {final}")
            discarded = os.path.join(checkpoint_dir, f".step_{state.step:08d}.g{runtime.generation}.discarded.tmp")
            shutil.rmtree(discarded, ignore_errors=True)
            os.rename(final, discarded)
            shutil.rmtree(discarded)
        os.rename(staging, final)
        _fsync_dir(checkpoint_dir)
        runtime.report_checkpoint(state.step, final, state.samples)
    dist.barrier()
    return final


def _fsync_tree(root: str) -> None:
    """fsyncs every file under ``root`` and then the directories, deepest first."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(directory)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
