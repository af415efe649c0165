"""The memory tier: a snapshot of every rank's shard, every ``--memory-checkpoint-every``
steps, in memory that outlives the rank, restored in place of the durable checkpoint
when it is newer. A failure then loses at most the steps since the last snapshot, not
those since the last durable checkpoint, and a restart reads memory, not storage.

Where: ``KEEL_MEMORY_DIR``, the job's directory in memory its node's agent holds (a
tmpfs, ``/dev/shm`` by default: it survives the ranks, not the node; the agent creates
it, bounds it and releases it when the job ends: ``agent.memory``). Layout::

    mem_00000041/            committed: step 41, whole on this node
        .metadata            DCP's global plan (every node holds its own copy)
        __0_0.distcp ...     the shard files of the ranks on this node
        snapshot.json        step, samples, job id, lineage, generation, world size
    .mem_00000042.g3.tmp/    being written by generation 3; never loaded

A snapshot holds what a durable checkpoint holds (``checkpoint.state_dict``: model and
optimizer under their global names, the trainer state with the data ledger and the RNG
state), saved by DCP through a ``FileSystemWriter`` without fsyncs: memory has nothing
to sync to. It is committed all or nothing. DCP's save returns on every rank only once
every rank's shards are written and its coordinator has written the metadata; then the
first rank of each node (local rank 0) writes the metadata there too where the
coordinator is elsewhere, and renames its node's staging directory to the committed
name. Double-buffered: the previous snapshot is removed only after every node has
committed the new one, so a save torn by a kill leaves the previous one whole on every
node, and a torn directory never has a committed name.

Restore (``choose``): every rank lists the committed snapshots of its job whose every
file its node holds in full (``whole``); the ranks agree on the newest one they all
hold, and it is restored if it is newer than the durable checkpoint the restore would
otherwise load. It loads through DCP's planner as a durable one does, so it reshards to
any world size and layout. Where a node lacks some rank's shard files (each node holds
only its own ranks'), the restore falls back to the durable checkpoint and rank 0 says
so.

Bounded: snapshots are taken only if two of them (the one kept and the one being
written) for every rank on the node fit ``KEEL_MEMORY_BUDGET_BYTES``; a save that fails
on the memory (a full tmpfs: ENOSPC) is skipped, logged, and tried again on schedule.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from trainer.runtime import Runtime
from trainer.storage_faults import storage_fault

INFO_FILE = "snapshot.json"
METADATA_FILE = ".metadata"
_COMMITTED = re.compile(r"mem_(\d{8,})")
_STAGING = re.compile(r"\.mem_\d{8,}\.g\d+\.tmp")


def snapshot_path(directory: str, step: int) -> str:
    """The committed snapshot of step ``step``."""
    return os.path.join(directory, f"mem_{step:08d}")


def staging_path(directory: str, step: int, generation: int) -> str:
    """Where generation ``generation`` writes step ``step``'s snapshot before commit."""
    return os.path.join(directory, f".mem_{step:08d}.g{generation}.tmp")


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot is of: ``step`` and ``samples`` (the data position after it),
    the ``job_id`` and ``lineage`` (job ids, origin first) it continues, the
    ``generation`` that wrote it and its ``world_size``."""

    step: int
    samples: int
    job_id: str
    lineage: tuple[str, ...]
    generation: int
    world_size: int

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, INFO_FILE), "w") as out:
            json.dump(asdict(self), out)

    @classmethod
    def read(cls, directory: str) -> SnapshotInfo:
        """Raises OSError, ValueError, KeyError or TypeError if it is not there or does
        not parse."""
        with open(os.path.join(directory, INFO_FILE)) as source:
            raw = json.load(source)
        return cls(
            step=int(raw["step"]),
            samples=int(raw["samples"]),
            job_id=str(raw["job_id"]),
            lineage=tuple(str(job) for job in raw["lineage"]),
            generation=int(raw["generation"]),
            world_size=int(raw["world_size"]),
        )


def committed(directory: str | None) -> dict[int, str]:
    """Step → path of every committed snapshot in ``directory``."""
    if not directory or not os.path.isdir(directory):
        return {}
    return {
        int(match.group(1)): os.path.join(directory, name)
        for name in os.listdir(directory)
        if (match := _COMMITTED.fullmatch(name))
    }


def whole(path: str) -> tuple[SnapshotInfo | None, str]:
    """The snapshot at ``path`` and "" if this node holds all of it (its info, its
    metadata and, in full, every file the metadata names), else None and why not."""
    try:
        info = SnapshotInfo.read(path)
        with open(os.path.join(path, METADATA_FILE), "rb") as source:
            metadata = pickle.load(source)
        needed: dict[str, int] = {}
        for stored in metadata.storage_data.values():
            end = stored.offset + stored.length
            needed[stored.relative_path] = max(needed.get(stored.relative_path, 0), end)
    except (OSError, ValueError, LookupError, TypeError, AttributeError, pickle.PickleError) as exc:
        return None, f"{path}: unreadable ({type(exc).__name__}: {exc})"
    for name, size in sorted(needed.items()):
        try:
            held = os.path.getsize(os.path.join(path, name))
        except OSError:
            return None, f"{path}: {name} is not on this node"
        if held < size:
            return None, f"{path}: {name} holds {held} of its {size} bytes"
    return info, ""


def state_bytes(state: object) -> int:
    """The bytes of the tensors in ``state`` (nested dicts and lists) this rank holds:
    its local shard of each DTensor."""
    if isinstance(state, DTensor):
        return state.to_local().nbytes
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


@dataclass(frozen=True)
class Chosen:
    """The snapshot every rank restores: its ``path`` (each rank's node's copy) and
    what it is of."""

    path: str
    info: SnapshotInfo


def choose(runtime: Runtime, durable_step: int) -> Chosen | None:
    """The newest snapshot of the job that every rank's node holds whole, if it is newer
    than ``durable_step`` (the durable checkpoint the restore would load; 0: none);
    else None. Collective. Rank 0 logs a newer snapshot that it cannot use, and why."""
    held: dict[int, SnapshotInfo] = {}
    problems: list[str] = []
    for step, path in sorted(committed(runtime.memory_dir).items(), reverse=True):
        if step <= durable_step:
            break
        info, problem = whole(path)
        if info is None:
            problems.append(problem)
        elif info.job_id != runtime.job_id or info.generation > runtime.generation:
            problems.append(f"{path}: of job {info.job_id!r} generation {info.generation}")
        else:
            held[step] = info
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(held), problems[:3]))
    common = set.intersection(*(set(steps) for steps, _ in everyone))
    if not common:
        if dist.get_rank() == 0 and any(steps or found for steps, found in everyone):
            reasons = sorted({problem for _, found in everyone for problem in found})
            lacking = [rank for rank, (steps, _) in enumerate(everyone) if not steps]
            runtime.log(
                "no memory snapshot newer than the durable checkpoint is whole on every "
                f"node (none on ranks {lacking[:8]}{'…' if len(lacking) > 8 else ''}"
                + (f"; {'; '.join(reasons[:3])}" if reasons else "")
                + "): restoring from storage"
            )
        return None
    step = max(common)
    if dist.get_rank() == 0 and problems:
        runtime.log(f"passing over memory snapshots: {'; '.join(problems[:3])}")
    return Chosen(snapshot_path(runtime.memory_dir, step), held[step])


def everywhere(runtime: Runtime) -> bool:
    """Whether every rank's agent holds memory for the job (so that every rank
    snapshots at the same steps, or none does). Collective; rank 0 says when some do
    and others do not."""
    mine = bool(runtime.memory_dir) and os.path.isdir(runtime.memory_dir or "")
    held = torch.tensor([int(mine), int(mine)], dtype=torch.int64)
    # One all-reduce for both: the minimum, and (negated) the maximum.
    held[1] = -held[1]
    dist.all_reduce(held, op=dist.ReduceOp.MIN)
    every, some = bool(held[0].item()), bool(-held[1].item())
    if some and not every and dist.get_rank() == 0:
        runtime.log("memory tier off: not every rank's agent holds memory for the job")
    return every


class MemoryTier:
    """Takes the snapshots of one generation, every ``every`` steps, into
    ``runtime.memory_dir`` (on every rank: ``everywhere``). Every rank calls ``save`` at
    the same steps. ``lineage``:
    the job ids this run continues, recorded in each snapshot."""

    def __init__(self, runtime: Runtime, *, every: int, lineage: tuple[str, ...]) -> None:
        self.directory = runtime.memory_dir or ""
        self.runtime = runtime
        self.every = every
        self.lineage = lineage
        self.generation = runtime.generation
        self.saved_step = 0
        self._rank = dist.get_rank()
        self._leader = runtime.local_rank == 0
        self._fits: bool | None = None
        self._blocked_s = 0.0
        # Its own group: the durable checkpointer's background write uses another.
        self._group = dist.new_group(backend="gloo")
        if self._leader:
            # What a generation that died while saving left; before any rank of this
            # one writes.
            for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
                if _STAGING.fullmatch(name):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        dist.barrier(group=self._group)

    def due(self, step: int, last_step: int) -> bool:
        """Whether a snapshot follows step ``step``: every ``every`` steps, but not
        after the last (the durable checkpoint is saved then), nor once it was found not
        to fit."""
        return (
            self.every > 0
            and step % self.every == 0
            and step < last_step
            and self._fits is not False
        )

    def take_blocked_s(self) -> float:
        """Seconds ``save`` held up the caller since the last call."""
        blocked_s, self._blocked_s = self._blocked_s, 0.0
        return blocked_s

    def save(self, step: int, samples: int, state: dict) -> bool:
        """Snapshots ``state`` (``checkpoint.state_dict``) of step ``step`` (``samples``:
        the data position after it) and commits it on every node; whether it was
        committed everywhere. Collective."""
        started = time.perf_counter()
        try:
            if self._fits is None:
                self._fits = self._check_budget(state)
            if not self._fits:
                return False
            return self._save(step, samples, state)
        finally:
            self._blocked_s += time.perf_counter() - started

    def _save(self, step: int, samples: int, state: dict) -> bool:
        staging = staging_path(self.directory, step, self.generation)
        final = snapshot_path(self.directory, step)
        try:
            os.makedirs(staging, exist_ok=True)
            metadata = dcp.save(
                state,
                storage_writer=FileSystemWriter(staging, sync_files=False),
                process_group=self._group,
            )
        # DCP raises CheckpointException, a BaseException, for a failed write.
        except (Exception, CheckpointException) as error:
            fault = storage_fault(error)
            if fault is None:
                raise
            if self._leader:
                shutil.rmtree(staging, ignore_errors=True)
            if self._rank == 0:
                self.runtime.log(
                    f"memory snapshot of step {step} not taken ({fault}); training goes "
                    "on, the next is tried on schedule",
                    step=step,
                )
            return False
        done = True
        if self._leader:
            done = self._commit(step, samples, staging, final, metadata)
        # Every node has committed it, or the previous one stays on every node.
        flag = torch.tensor([int(done)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        if not flag.item():
            return False
        self.saved_step = step
        if self._leader:
            for older, path in committed(self.directory).items():
                if older != step:
                    shutil.rmtree(path, ignore_errors=True)
        return True

    def _commit(self, step: int, samples: int, staging: str, final: str, metadata) -> bool:
        """A node's first rank: the metadata and info beside its shards, then the
        committed name; whether it is there."""
        try:
            if self._rank != 0:
                # As DCP's writer stores it, so that its reader reads it here.
                with open(os.path.join(staging, METADATA_FILE), "wb") as out:
                    pickle.dump(metadata, out)
            SnapshotInfo(
                step=step,
                samples=samples,
                job_id=self.runtime.job_id,
                lineage=self.lineage,
                generation=self.generation,
                world_size=dist.get_world_size(),
            ).write(staging)
            # One of an earlier generation's (it ran past the step this one restored).
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staging, final)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            self.runtime.log(
                f"memory snapshot of step {step} not committed on this node: {error}", step=step
            )
            return False
        return True

    def _check_budget(self, state: dict) -> bool:
        """Whether two snapshots of every rank on each node fit its budget; rank 0
        logs what was decided. Collective."""
        largest = torch.tensor([state_bytes(state)], dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self._group)
        need = 2 * int(largest.item()) * max(self.runtime.local_world_size, 1)
        budget = self.runtime.memory_budget_bytes
        fits = torch.tensor([int(budget <= 0 or need <= budget)], dtype=torch.int64)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self._group)
        if self._rank == 0:
            gib = need / 2**30
            self.runtime.log(
                f"memory tier: snapshots every {self.every} steps in {self.directory}, "
                f"{gib:.3f} GiB per node for two"
                if fits.item()
                else f"memory tier off: two snapshots take {gib:.3f} GiB per node, more "
                f"than the {budget / 2**30:.3f} GiB the agent may hold (keel agent "
                "--memory-budget-gb); durable checkpoints only"
            )
        return bool(fits.item())
