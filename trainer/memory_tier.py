"""The memory tier: a snapshot of every rank's shard, every ``--memory-checkpoint-every``
steps, in memory that outlives the rank, restored in place of the durable checkpoint
when it is newer. A failure then loses at most the steps since the last snapshot, not
those since the last durable checkpoint, and a restart reads memory, not storage.

Where: ``KEEL_MEMORY_DIR``, the job's directory in memory its node's agent holds (a
tmpfs, ``/dev/shm`` by default: it survives the ranks, not the node; the agent creates
it, bounds it and releases it when the job ends: ``agent.memory``). Layout::

    mem_00000041/            committed: step 41, this node's copy whole
        .metadata            DCP's metadata of the snapshot, naming this node's copies
        __0.mem ...          each rank of the node: its tensor chunks' raw bytes
        __0.obj ...          and its other objects, pickled
        snapshot.json        step, samples, job id, lineage, generation, world size,
                             the ranks whose files this node holds
    .mem_00000042.g3.tmp/    being written by generation 3; never loaded

A snapshot holds what a durable checkpoint holds (``checkpoint.state_dict``: model and
optimizer under their global names, the trainer state with the data ledger and the RNG
state). What each rank writes is planned once per generation by DCP's own save planner
(``_Plan``: the same items DCP would save, each chunk written once across the ranks, and
on each node what its ranks hold that DCP saves on another node's rank: a chunk
replicated across nodes) and reused by every snapshot after, so a snapshot is one copy
of the rank's chunks into memory and two small all-reduces, not DCP's planning round,
per-tensor serialization and object gathers every step; and it overlaps the next step's
forward and backward (``MemoryTier``). It is committed all or nothing: every rank writes
its files into its node's staging directory (the first rank of each node also the
metadata and the info); once every rank has written, the first rank of each node renames
the directory to its committed name. Double-buffered: the previous snapshot is removed
only after every node has committed the new one, so a save torn by a kill leaves the
previous one whole on every node, and a torn directory never has a committed name. Once
every node has committed it, rank 0 reports it to its agent
(``Runtime.report_memory_snapshot``), and the controller records it beside the durable
checkpoint.

Restore (``choose``): every rank lists the committed snapshots of its job that its node
holds whole and that hold every file the rank's restore reads (``files_read``: DCP's
load planner's reads for the rank's state); the ranks agree on the newest one they all
hold, and it is restored if it is newer than the durable checkpoint the restore would
otherwise load. It loads through DCP's load planner as a durable one does, by a storage
reader over the memory (``SnapshotReader``), so it reshards to any world size and
layout whose reads its nodes hold: any, on one node; across nodes, the same layout on
the same nodes (each node holds its own ranks' files), as after a rank's crash or a
hang. Where a rank would read a file its node lacks (another layout, a rank on another
node, a node lost), the restore falls back to the durable checkpoint and rank 0 says
why.

Bounded: snapshots are taken only if two of them (the one kept and the one being
written) for every rank on the node fit ``KEEL_MEMORY_BUDGET_BYTES``; a save that fails
on the memory (a full tmpfs: ENOSPC) is skipped, logged, and tried again on schedule.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import mmap
import os
import pickle
import re
import shutil
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from trainer.runtime import Runtime

INFO_FILE = "snapshot.json"
METADATA_FILE = ".metadata"
_COMMITTED = re.compile(r"mem_(\d{8,})")
_STAGING = re.compile(r"\.mem_(\d{8,})\.g(\d+)\.tmp")


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
    ``generation`` that wrote it and its ``world_size``; ``ranks``, the ranks whose
    files this node's copy holds (empty in a snapshot written before copies said: every
    rank's)."""

    step: int
    samples: int
    job_id: str
    lineage: tuple[str, ...]
    generation: int
    world_size: int
    ranks: tuple[int, ...] = ()

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
            ranks=tuple(int(rank) for rank in raw.get("ranks", ())),
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


def candidates(directory: str | None) -> dict[int, list[str]]:
    """Step → the paths that may hold its snapshot in ``directory``: the committed one
    first, then any generation's staging directory, newest generation first. A staging
    directory whose every rank's files were written before its commit ended (the
    commit waits for the slowest rank, and a failure can land between) is as good as
    a committed one: ``whole`` tells."""
    found: dict[int, list[tuple[int, str]]] = {}
    if not directory or not os.path.isdir(directory):
        return {}
    for name in os.listdir(directory):
        if match := _COMMITTED.fullmatch(name):
            rank = (-1, 0)  # before any staging directory
        elif match := _STAGING.fullmatch(name):
            rank = (0, -int(match.group(2)))
        else:
            continue
        found.setdefault(int(match.group(1)), []).append((rank, os.path.join(directory, name)))
    return {step: [path for _, path in sorted(paths)] for step, paths in found.items()}


def whole(
    path: str, reads: Callable[[Metadata], set[str]] | None = None
) -> tuple[SnapshotInfo | None, str]:
    """The snapshot at ``path`` and "" if this node's copy is whole (its info, its
    metadata and, in full, the files of every rank the info names) and holds every
    file ``reads(metadata)`` names (the files a rank's restore reads: ``files_read``),
    else None and why not."""
    try:
        info = SnapshotInfo.read(path)
        with open(os.path.join(path, METADATA_FILE), "rb") as source:
            metadata = pickle.load(source)
        needed: dict[str, int] = {}
        objects: dict[str, list[MetadataIndex]] = {}
        for index, stored in metadata.storage_data.items():
            if stored.dtype is None:
                objects.setdefault(stored.relative_path, []).append(index)
                continue
            end = stored.offset + stored.length
            needed[stored.relative_path] = max(needed.get(stored.relative_path, 0), end)
        files = set(needed) | set(objects)
        if info.ranks:
            files = {name for name in files if _rank_of(name) in info.ranks}
    except (
        OSError,
        ValueError,
        LookupError,
        TypeError,
        AttributeError,
        RuntimeError,
        pickle.PickleError,
    ) as exc:
        return None, f"{path}: unreadable ({type(exc).__name__}: {exc})"
    try:
        read = reads(metadata) if reads is not None else set()
    except (RuntimeError, LookupError, ValueError) as exc:
        # DCP's planner: the state restored has a key (or a shape) the snapshot lacks.
        return None, (
            f"{path}: does not hold this rank's state ({exc}): the model or its optimizer "
            "is not the one snapshotted"
        )
    elsewhere = sorted(read - files)
    if elsewhere:
        return None, (
            f"{path}: this rank reads {elsewhere[0]}, which another node's copy holds (this "
            f"node's holds ranks {list(info.ranks)}'s files: the layout or the placement "
            "changed)"
        )
    for name in sorted(files):
        if not os.path.isfile(os.path.join(path, name)):
            return None, f"{path}: {name} is not on this node"
    for name, size in sorted(needed.items()):
        if name not in files:
            continue
        held = os.path.getsize(os.path.join(path, name))
        if held < size:
            return None, f"{path}: {name} holds {held} of its {size} bytes"
    for name, indexes in sorted(objects.items()):
        if name not in files:
            continue
        try:
            held_objects = _read_objects(os.path.join(path, name))
        except (OSError, ValueError, EOFError, pickle.PickleError) as exc:
            return None, f"{path}: {exc}"
        lacking = [index.fqn for index in indexes if index not in held_objects]
        if lacking:
            return None, f"{path}: {name} lacks {lacking[0]}"
    return info, ""


def files_read(metadata: Metadata, state: dict) -> set[str]:
    """The files of a snapshot (with ``metadata``, its node's) that loading it into
    ``state`` (``checkpoint.load_target``: this rank's) reads, as DCP's load planner
    plans the reads. Raises RuntimeError or KeyError if ``state`` has what the snapshot
    lacks."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {
        metadata.storage_data[item.storage_index].relative_path
        for item in planner.create_local_plan().items
    }


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
class Extent:
    """Where one stored item of a snapshot is, in the metadata's ``storage_data``: a
    tensor chunk's raw bytes at ``offset`` (``length`` bytes, ``dtype`` and ``shape``)
    in ``relative_path``, or (``dtype`` None) an object in the rank's object file,
    ``relative_path``, found by its index."""

    relative_path: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()


def _tensor_file(rank: int) -> str:
    return f"__{rank}.mem"


_RANK_FILE = re.compile(r"__(\d+)\.(?:mem|obj)")


def _rank_of(name: str) -> int:
    """The rank whose file ``name`` is (-1: none's)."""
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1)) if match else -1


def _object_file(rank: int) -> str:
    return f"__{rank}.obj"


class _Plan:
    """What each rank writes into a snapshot, planned once by DCP's planner for a
    state of a given shape and reused by every snapshot after: which items this rank
    writes, where each lies in its rank's files, and the metadata of its node's copy,
    through which DCP's load planner reads any chunk its node holds into any layout
    (``SnapshotReader``).

    Each chunk and object of the state is written once on every node that holds it:
    first the items DCP's global plan gives the rank (each once across all ranks),
    then the items of the rank's state that no rank of its node was given (a chunk
    replicated across nodes, which DCP saves on one of them). So each node's copy holds
    everything its ranks hold, and a restore in the same layout on the same nodes reads
    its node's memory alone; each node's metadata names its own copy of such an item.
    ``ranks``: the ranks of this rank's node (which write into its directory)."""

    def __init__(
        self,
        items: list[WriteItem],
        metadata: Metadata,
        signature: tuple,
        total_bytes: int,
        ranks: tuple[int, ...],
    ) -> None:
        self.items = items
        self.metadata_bytes = pickle.dumps(metadata)
        self.signature = signature
        self.tensor_bytes = sum(
            metadata.storage_data[item.index].length
            for item in items
            if item.type != WriteItemType.BYTE_IO
        )
        self.total_bytes = total_bytes  # the state's, once: the controller records it
        self.ranks = ranks

    @classmethod
    def make(cls, state: dict, group: dist.ProcessGroup, node: object) -> _Plan:
        """Collective over ``group``: every rank's local plan and ``node`` (where it
        writes: the same for the ranks of a node, and only for them) to every rank,
        each of which makes the same global plan from them."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict=state, is_coordinator=False)
        local = planner.create_local_plan()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (local, node), group=group)
        nodes = [where for _, where in gathered]
        final_plans, metadata = planner.create_global_plan([plan for plan, _ in gathered])
        # The items each node writes: the global plan's of its ranks, then, on the first
        # of its ranks that holds it, any other item of its ranks' state.
        written: dict[object, set[MetadataIndex]] = {}
        for rank, plan in enumerate(final_plans):
            written.setdefault(nodes[rank], set()).update(item.index for item in plan.items)
        extra: list[list[WriteItem]] = [[] for _ in final_plans]
        for rank, (plan, _) in enumerate(gathered):
            held = written[nodes[rank]]
            for item in plan.items:
                if item.index not in held:
                    held.add(item.index)
                    extra[rank].append(item)
        storage: dict[MetadataIndex, Extent] = {}
        own: dict[MetadataIndex, Extent] = {}  # the extra items of this node's ranks
        for rank, plan in enumerate(final_plans):
            offset = 0
            for number, item in enumerate([*plan.items, *extra[rank]]):
                into = storage if number < len(plan.items) else own
                if nodes[rank] != node and into is own:
                    continue
                if item.type == WriteItemType.BYTE_IO:
                    into[item.index] = Extent(_object_file(rank), 0, 0)
                    continue
                chunk = item.tensor_data.chunk
                dtype = item.tensor_data.properties.dtype
                length = math.prod(chunk.sizes) * dtype.itemsize
                into[item.index] = Extent(
                    _tensor_file(rank), offset, length, dtype, tuple(chunk.sizes)
                )
                offset += length
        total_bytes = sum(extent.length for extent in storage.values() if extent.dtype is not None)
        metadata.storage_data = {**storage, **own}
        rank = dist.get_rank(group)
        own_plan = final_plans[rank]
        mine = dataclasses.replace(own_plan, items=[*own_plan.items, *extra[rank]])
        ranks = tuple(other for other, where in enumerate(nodes) if where == node)
        return cls(
            planner.finish_plan(mine).items, metadata, _signature(planner), total_bytes, ranks
        )

    def prepare(self, state: dict) -> _Copy | None:
        """What this rank writes of ``state``: its tensor chunks, as host buffers in
        the planned order, and its objects, pickled now (the training loop changes
        them); None if ``state`` is no longer of the planned shape. On the training
        thread: what is left for the snapshot's thread needs no interpreter lock."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict=state, is_coordinator=False)
        if _signature(planner) != self.signature:
            return None
        objects: dict[MetadataIndex, object] = {}
        buffers: list[memoryview] = []
        for item in self.items:
            if item.type == WriteItemType.BYTE_IO:
                # Pickled together, not each through torch.save as DCP's writer stores
                # them: dozens of small objects (learning rates, betas) would cost a
                # zip archive each.
                objects[item.index] = planner.lookup_object(item.index)
                continue
            tensor = planner.resolve_data(item).detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            buffers.append(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        payload = pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
        return _Copy(buffers, struct.pack(_FRAME, len(payload)) + payload)


@dataclass
class _Copy:
    """One rank's part of one snapshot, ready to be written: ``buffers``, its tensor
    chunks' bytes (views of the state itself on a host: valid until the optimizer
    changes it), and ``objects``, its framed object file."""

    buffers: list[memoryview]
    objects: bytes

    def write(self, directory: str, rank: int) -> None:
        """Into ``directory``: the chunks one after another, then the objects."""
        path = os.path.join(directory, _tensor_file(rank))
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for buffer in self.buffers:
                _write_all(descriptor, buffer)
        finally:
            os.close(descriptor)
        with open(os.path.join(directory, _object_file(rank)), "wb") as out:
            out.write(self.objects)


def _write_all(descriptor: int, buffer: memoryview) -> None:
    """All of ``buffer`` (one write returns at most 2 GiB on Linux)."""
    done = 0
    while done < len(buffer):
        done += os.write(descriptor, buffer[done:])


_FRAME = "<Q"  # an object file's payload length, before it


def _signature(planner: DefaultSavePlanner) -> tuple:
    """The shape of the (flattened) state a planner was set up with: each key, and of
    each tensor its local shape and type."""
    shapes = []
    for key, value in planner.state_dict.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            shapes.append((key, tuple(value.shape), value.dtype))
        else:
            shapes.append((key,))
    return tuple(shapes)


def _read_objects(path: str) -> dict:
    """A rank's object file; raises OSError or ValueError if it is not whole."""
    with open(path, "rb") as source:
        frame = source.read(struct.calcsize(_FRAME))
        if len(frame) < struct.calcsize(_FRAME):
            raise ValueError(f"{os.path.basename(path)} is cut short")
        (length,) = struct.unpack(_FRAME, frame)
        payload = source.read(length + 1)
    if len(payload) != length:
        raise ValueError(
            f"{os.path.basename(path)} holds {len(payload)} of its {length} bytes of objects"
        )
    return pickle.loads(payload)


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Reads into all of ``view`` from ``offset`` of ``fd``; the bytes read (fewer at
    the end of the file). One read returns at most 2 GiB on Linux."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            break
        done += count
    return done


def _reads_whole(item: ReadItem, extent: Extent, target: torch.Tensor) -> bool:
    """Whether ``item`` reads all of the chunk at ``extent`` into all of ``target``, a
    contiguous host tensor of the chunk's type: then the bytes go straight into it."""
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == extent.dtype
        and tuple(item.lengths) == extent.shape
        and not any(item.storage_offsets)
        and target.nbytes == extent.length
    )


def _narrowed(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The box of ``tensor`` at ``offsets`` of ``lengths`` (per dimension)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


class SnapshotReader(StorageReader):
    """DCP's storage reader over a snapshot in memory: ``dcp.load(state,
    storage_reader=SnapshotReader(path))`` reads it into any world size and layout as
    a durable checkpoint is read, each chunk straight from its rank's file (mapped,
    not copied) into the shard of the target that needs it."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.storage_data: dict[MetadataIndex, Extent] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(os.path.join(self.path, METADATA_FILE), "rb") as source:
            return pickle.load(source)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, items in per_file.items():
            path = os.path.join(self.path, name)
            if items[0].type == LoadItemType.BYTE_IO:
                objects = _read_objects(path)
                for item in items:
                    # In the form DCP's load planner reads.
                    stream = io.BytesIO()
                    torch.save(objects[item.storage_index], stream)
                    stream.seek(0)
                    planner.load_bytes(item, stream)
                continue
            with open(path, "rb") as source:
                mapped: mmap.mmap | None = None
                for item in items:
                    extent = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    if _reads_whole(item, extent, target):
                        # The chunk is the target (the same layout): read straight in.
                        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                        if _read_into(source.fileno(), view, extent.offset) != extent.length:
                            raise ValueError(f"{path}: {item.storage_index.fqn} is cut short")
                        planner.commit_tensor(item, target)
                        continue
                    if mapped is None:
                        mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_COPY)
                    stored = torch.frombuffer(
                        mapped, dtype=torch.uint8, count=extent.length, offset=extent.offset
                    )
                    stored = stored.view(extent.dtype).reshape(extent.shape)
                    stored = _narrowed(stored, item.storage_offsets, item.lengths)
                    if target.size() != stored.size():
                        raise ValueError(
                            f"{path}: {item.storage_index.fqn} is {tuple(stored.size())} "
                            f"where {tuple(target.size())} is read"
                        )
                    target.copy_(stored)
                    planner.commit_tensor(item, target)
                    del stored
                if mapped is not None:
                    mapped.close()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(str(checkpoint_id), INFO_FILE))


@dataclass(frozen=True)
class Chosen:
    """The snapshot every rank restores: its ``path`` (each rank's node's copy) and
    what it is of."""

    path: str
    info: SnapshotInfo


def choose(
    runtime: Runtime, durable_step: int, reads: Callable[[Metadata], set[str]] | None = None
) -> Chosen | None:
    """The newest snapshot of the job whose every rank's node holds its copy whole and
    every file the rank reads (``reads``: ``files_read`` of the rank's state; None:
    every file), if it is newer than ``durable_step`` (the durable checkpoint the
    restore would load; 0: none); else None. Collective. Rank 0 logs a newer snapshot
    that it cannot use, and why."""
    held: dict[int, Chosen] = {}
    problems: list[str] = []
    for step, paths in sorted(candidates(runtime.memory_dir).items(), reverse=True):
        if step <= durable_step:
            break
        for path in paths:
            info, problem = usable(path, step, runtime, reads)
            if info is not None:
                held[step] = Chosen(path, info)
                break
            problems.append(problem)
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
    return held[step]


def usable(
    path: str,
    step: int,
    runtime: Runtime,
    reads: Callable[[Metadata], set[str]] | None = None,
) -> tuple[SnapshotInfo | None, str]:
    """``whole`` (with ``reads``), and of step ``step`` of this job by a generation
    before this one (or this one, restarted); else None and why not."""
    info, problem = whole(path, reads)
    if info is None:
        return None, problem
    if info.step != step:
        return None, f"{path}: holds step {info.step}"
    if info.job_id != runtime.job_id or info.generation > runtime.generation:
        return None, f"{path}: of job {info.job_id!r} generation {info.generation}"
    return info, ""


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


def bounded_interval(
    cost_s: float, step_s: float, overhead_max: float, every: int, current: int
) -> int:
    """The least interval, ``every`` or more, at which snapshots costing ``cost_s``
    each take at most ``overhead_max`` of steps of ``step_s``; ``current`` is kept
    unless it is too short or a quarter longer than needed (no flapping)."""
    wanted = max(every, math.ceil(cost_s / (overhead_max * step_s)))
    if wanted > current or wanted < 0.75 * current:
        return wanted
    return current


class MemoryTier:
    """Takes the snapshots of one generation, every ``every`` steps, into
    ``runtime.memory_dir`` (on every rank: ``everywhere``). Every rank calls ``save`` at
    the same steps. ``lineage``: the job ids this run continues, recorded in each
    snapshot.

    A snapshot overlaps the next step: ``save`` hands it to a thread of its own and
    returns; the thread copies the rank's chunks into memory, then commits with its
    peers on the tier's own gloo group. The step's forward and backward read the state
    while it is copied; ``before_update``, called before the optimizer changes the
    state, waits for this rank's copy to end (normally it has), and the next ``save``
    for the commit. ``close`` at the end of a run, ``settle`` after a failure.

    Bounded in time as in memory: with ``overhead_max`` F > 0, each snapshot measures
    what it cost against the steps since the one before, the slowest rank's: the loop's
    period (``before_update`` to ``before_update``) with it against the median period
    without (summed from its parts while there are none), and where a snapshot every
    ``every`` steps would take more than F of the training time the interval grows to
    the least that keeps it under F (and shrinks back when it can). Every rank computes
    the same interval from the same all-reduced figures and adopts it at the same
    snapshot."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        every: int,
        lineage: tuple[str, ...],
        overhead_max: float = 0.0,
    ) -> None:
        self.directory = runtime.memory_dir or ""
        self.runtime = runtime
        self.every = every
        self.interval = every  # the steps between snapshots now: ``every`` or more
        self.overhead_max = overhead_max
        self.lineage = lineage
        self.generation = runtime.generation
        self.saved_step = 0
        self._rank = dist.get_rank()
        self._leader = runtime.local_rank == 0
        # Where this rank writes: the ranks of a node share it, and no other rank does.
        self._node = (runtime.node, socket.gethostname(), os.path.realpath(self.directory))
        self._fits: bool | None = None
        self._plan: _Plan | None = None
        self._blocked_s = 0.0
        self._update_wait_s = 0.0
        self._last_step: int | None = None  # of the last snapshot started
        self._last_at = 0.0  # perf_counter seconds, when it started
        self._waited_s = 0.0  # in ``before_update`` since the last snapshot started
        # Seconds between ``before_update`` calls since the last snapshot started: the
        # loop's periods with it in them (its share, and the step beside its copy) and
        # the periods without.
        self._periods: tuple[list[float], list[float]] = ([], [])
        self._period_began: float | None = None
        self._shadowed = False
        self._unlike = False  # the period now holds what the others do not
        self._measured: tuple[float, float] | None = None  # seconds: snapshot, step
        self._next_interval = every
        self._failing_since: int | None = None  # the first of the snapshots failing now
        self._not_taken = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-memory")
        self._in_flight: Future | None = None
        self._copied = threading.Event()
        self._copied.set()
        # Its own group, used by its thread alone: the training loop's collectives run
        # on others meanwhile, and the durable checkpointer's background write on
        # another still.
        self._group = dist.new_group(backend="gloo")
        if self._leader:
            self._tidy()
        dist.barrier(group=self._group)

    def _tidy(self) -> None:
        """A node's first rank, before any rank of this generation writes: what a
        generation that died while saving left. A staging directory this node holds
        whole takes its committed name (it may be all a restore after this generation
        has; the restore checks every node holds it); any other goes."""
        held = committed(self.directory)
        for step, paths in candidates(self.directory).items():
            for path in paths:
                if path == held.get(step):
                    continue
                info, _ = usable(path, step, self.runtime)
                if info is not None and step not in held:
                    try:
                        held[step] = snapshot_path(self.directory, step)
                        os.rename(path, held[step])
                        continue
                    except OSError:
                        pass
                shutil.rmtree(path, ignore_errors=True)

    def due(self, step: int, last_step: int) -> bool:
        """Whether a snapshot follows step ``step``: every ``interval`` steps (the
        first at a multiple of ``every``), but not after the last (the durable
        checkpoint is saved then), nor once it was found not to fit."""
        if self.every <= 0 or step >= last_step or self._fits is False:
            return False
        if self._last_step is None:
            return step % self.every == 0
        return step - self._last_step >= self.interval

    def take_blocked_s(self) -> float:
        """Seconds ``save`` and ``before_update`` held up the caller since the last
        call."""
        blocked_s, self._blocked_s = self._blocked_s, 0.0
        return blocked_s

    def take_update_wait_s(self) -> float:
        """Seconds of them ``before_update`` held up a step since the last call (the
        step's own time, which peers compare, is without them)."""
        waited_s, self._update_wait_s = self._update_wait_s, 0.0
        return waited_s

    def save(self, step: int, samples: int, state: dict, built_s: float = 0.0) -> None:
        """Starts the snapshot of ``state`` (``checkpoint.state_dict``, built in
        ``built_s`` seconds) of step ``step`` (``samples``: the data position after
        it), once the one before has ended. Collective."""
        started = time.perf_counter()
        try:
            self.wait()
            self._adopt_interval(step)
            if self._fits is None:
                self._fits = self._check_budget(state)
            if not self._fits:
                return
            if self._plan is None:
                self._plan = _Plan.make(state, self._group, self._node)
            copy = self._plan.prepare(state)
            steps = step - self._last_step if self._last_step is not None else 0
            period_s = started - self._last_at if self._last_step is not None else 0.0
            self._last_step, self._last_at = step, started
            self._copied.clear()
            # The waits the snapshot before caused count here (they end as its copy does).
            cost_s = built_s + self._waited_s + time.perf_counter() - started
            self._waited_s = 0.0
            plain_s = period_s / steps - cost_s / steps if steps else 0.0
            shadow, clean = self._periods
            measured = bool(shadow and clean)
            if measured:
                # Measured, not summed from parts: the loop's period with the last
                # snapshot (its share of the training thread, and the step it slowed by
                # the copy beside it) against the periods without.
                plain_s = statistics.median(clean)
                cost_s = max(0.0, statistics.fmean(shadow) - plain_s)
            self._periods = ([], [])
            self._shadowed = True
            self._in_flight = self._writer.submit(
                self._save, step, samples, copy, (cost_s, plain_s, measured)
            )
        finally:
            self._blocked_s += time.perf_counter() - started

    def _adopt_interval(self, step: int) -> None:
        """The interval the last snapshot's figures call for, from this snapshot on
        (every rank adopts it here, at the same step); rank 0 says when it changes."""
        if self._next_interval == self.interval:
            return
        before, self.interval = self.interval, self._next_interval
        if self._rank == 0 and self._measured is not None:
            cost_s, step_s = self._measured
            self.runtime.log(
                f"memory tier: a snapshot costs {cost_s * 1000:.1f} ms against "
                f"{step_s * 1000:.1f} ms steps; every {self.interval} steps (was "
                f"{before}) to take at most {self.overhead_max:.1%} of the training time",
                step=step,
            )

    def _interval_for(self, cost_s: float, step_s: float) -> int:
        """The interval the bound calls for after a snapshot that cost ``cost_s``
        against steps of ``step_s`` without one (``bounded_interval``)."""
        if self.overhead_max <= 0 or step_s <= 0:
            return self.interval
        if self._measured is None:
            self._measured = (cost_s, step_s)
        else:
            old_cost, old_step = self._measured
            self._measured = (0.7 * old_cost + 0.3 * cost_s, 0.7 * old_step + 0.3 * step_s)
        return bounded_interval(*self._measured, self.overhead_max, self.every, self.interval)

    def before_update(self) -> None:
        """Returns once the snapshot in flight has copied this rank's state, which the
        caller is about to change. Called once a step: it also times the loop's
        period, with a snapshot in it or without, for the bound."""
        started = time.perf_counter()
        if self._period_began is not None and not self._unlike:
            self._periods[0 if self._shadowed else 1].append(started - self._period_began)
        self._period_began, self._shadowed, self._unlike = started, False, False
        if self._copied.is_set():
            return
        self._copied.wait()
        waited_s = time.perf_counter() - started
        self._update_wait_s += waited_s
        self._waited_s += waited_s
        self._blocked_s += waited_s

    def set_period_apart(self) -> None:
        """The loop's period now holds work the others do not (a durable checkpoint's
        save): it is not counted for the bound."""
        self._unlike = True

    def wait(self) -> bool:
        """Waits for the snapshot in flight to be committed or given up on every rank;
        whether there was one and it was committed. Raises what failed it other than
        the memory (that is logged, and the snapshot skipped)."""
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.result() if in_flight is not None else False

    def settle(self, timeout_s: float) -> bool:
        """After the run failed: waits up to ``timeout_s`` for the snapshot in flight to
        end, however it ends; whether it did (a rank whose thread did not end may not
        live on into another generation: it would go on writing as this one)."""
        in_flight, self._in_flight = self._in_flight, None
        self._writer.shutdown(wait=False)
        if in_flight is None:
            return True
        try:
            in_flight.result(timeout=timeout_s)
        except FutureTimeout:
            return False
        except BaseException as error:
            self.runtime.log(
                f"a memory snapshot failed with the run: {type(error).__name__}: {str(error)[:200]}"
            )
        return True

    def close(self) -> None:
        """At the end of a run: the snapshot in flight ends, and the thread with it."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    def _save(
        self, step: int, samples: int, copy: _Copy | None, figures: tuple[float, float, bool]
    ) -> bool:
        """The snapshot's thread: ``copy`` written (None: the state no longer fits the
        plan) and committed with every rank; whether it was. ``figures``: the last
        snapshot's cost, the step time without one, and whether they were measured
        (else the parts were summed: this copy is added)."""
        cost_s, step_s, measured = figures
        staging = staging_path(self.directory, step, self.generation)
        final = snapshot_path(self.directory, step)
        wrote, replan = True, False
        copying = time.perf_counter()
        try:
            os.makedirs(staging, exist_ok=True)
            replan = copy is None
            if copy is not None:
                copy.write(staging, self._rank)
            wrote = not replan
            if wrote and self._leader:
                with open(os.path.join(staging, METADATA_FILE), "wb") as out:
                    out.write(self._plan.metadata_bytes)
                SnapshotInfo(
                    step=step,
                    samples=samples,
                    job_id=self.runtime.job_id,
                    lineage=self.lineage,
                    generation=self.generation,
                    world_size=dist.get_world_size(),
                    ranks=self._plan.ranks,
                ).write(staging)
        except OSError as error:
            wrote = False
            # Said once while snapshots keep failing (a full tmpfs stays full), and
            # again when one is taken.
            if (self._rank == 0 or self._leader) and self._failing_since is None:
                self.runtime.log(
                    f"memory snapshot of step {step} not taken on this node ({error}); "
                    "training goes on, the next is tried on schedule (not said again "
                    "until one is taken)",
                    step=step,
                )
        finally:
            # The state may change now: what is left is the commit.
            self._copied.set()
        if not measured:
            cost_s += time.perf_counter() - copying
        # Every rank wrote its files, or none commits; a rank whose state no longer
        # matches the plan asks every rank for a new one, at the next snapshot. With
        # them the slowest rank's cost and step time (negated: a maximum by MIN).
        flags = torch.tensor(
            [int(wrote), -int(replan), -round(cost_s * 1e6), -round(step_s * 1e6)],
            dtype=torch.int64,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._group)
        if flags[1].item():
            self._plan = None
        self._next_interval = self._interval_for(-flags[2].item() / 1e6, -flags[3].item() / 1e6)
        if not flags[0].item():
            if self._leader:
                shutil.rmtree(staging, ignore_errors=True)
            if not flags[1].item():
                self._not_taken += 1
                if self._failing_since is None:
                    self._failing_since = step
            return False
        done = True
        if self._leader:
            done = self._commit(step, staging, final)
        # Every node has committed it, or the previous one stays on every node.
        flag = torch.tensor([int(done)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        if not flag.item():
            return False
        self.saved_step = step
        if self._rank == 0:
            # Complete on every node: the controller records it beside the durable one.
            self.runtime.report_memory_snapshot(
                step,
                samples,
                size=self._plan.total_bytes if self._plan else 0,
                save_s=time.perf_counter() - copying,
            )
        if self._failing_since is not None:
            if self._rank == 0:
                self.runtime.log(
                    f"memory snapshots taken again from step {step}, after {self._not_taken} "
                    f"not taken since step {self._failing_since}",
                    step=step,
                )
            self._failing_since, self._not_taken = None, 0
        if self._leader:
            for older, path in committed(self.directory).items():
                if older != step:
                    shutil.rmtree(path, ignore_errors=True)
        return True

    def _commit(self, step: int, staging: str, final: str) -> bool:
        """A node's first rank: the committed name for its node's copy; whether it is
        there."""
        try:
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
                f"memory tier: snapshots every {self.every} steps"
                + (
                    f" (less often where they take more than {self.overhead_max:.1%} of the "
                    "training time)"
                    if self.overhead_max > 0
                    else ""
                )
                + f" in {self.directory}, {gib:.3f} GiB per node for two"
                if fits.item()
                else f"memory tier off: two snapshots take {gib:.3f} GiB per node, more "
                f"than the {budget / 2**30:.3f} GiB the agent may hold (keel agent "
                "--memory-budget-gb); durable checkpoints only"
            )
        return bool(fits.item())
