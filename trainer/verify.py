"""Whether a checkpoint can be restored, and if not whose problem that is: a
``Verdict``.

* ``OK``: every file its manifest (``trainer.manifest``) lists is there, of its size
  and CRC-32.
* ``UNVERIFIED``: it has no manifest (written before manifests, or by plain DCP), but
  DCP's ``.metadata`` loads and every file it references is there and at least as long
  as the pieces it places in it: loadable, with a warning.
* ``DAMAGED``: proven damage, and only that: a file of another size or CRC than its
  manifest says, a listed file absent from a directory that is there and readable,
  ``.metadata`` that cannot be loaded (or, without a manifest, a file it needs absent or
  short), a manifest that does not parse (or lists no ``.metadata``), a file where the
  directory should be. The checkpoint is never good; quarantine it.
* ``UNREACHABLE``: the directory (or one of its files) cannot be read on some node:
  missing there (ENOENT on the directory itself: a mount absent on one node), EACCES,
  EIO, ESTALE... A problem of that node, not of the checkpoint: ``nodes`` names them.

``check_alone`` is the reference rule: one process looks at everything. ``check`` is
the same rule with the reading split: collective, every rank calls it with the same
path; rank 0 reads the manifest (or ``.metadata``) and plans, the files are shared out
between the ranks by bytes (``shares``), each rank checks its share on up to
``manifest.CRC_THREADS`` threads, and the findings are combined (``combine``) so that
every rank returns the same verdict. A checkpoint is then read at the pace of every
node's disk and cores together rather than one's. Each rank also checks that its node
sees the directory, and the same manifest as rank 0: a rank that cannot load the
checkpoint makes it UNREACHABLE even with no file of its share.

Combining: DAMAGED (the lowest rank's finding) beats UNREACHABLE, and UNREACHABLE beats
the verdict every file passing would give. Damage proven by any reader means that the
checkpoint can never be restored, wherever the job moves; an unreachable checkpoint
may well be whole, and the job should try it from other nodes rather than quarantine
it. UNREACHABLE names the first rank that could not read it, and every node on which a
rank could not.

Without a manifest, ``.metadata`` is unpickled (as ``dcp.load`` would): check only
paths the job may load from.
"""

from __future__ import annotations

import enum
import errno
import heapq
import os
import socket
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from trainer import manifest
from trainer.checkpoint_dir import METADATA_FILE
from trainer.manifest import MANIFEST_FILE, MalformedManifest, Manifest


class VerdictKind(str, enum.Enum):
    OK = "OK"
    UNVERIFIED = "UNVERIFIED"
    DAMAGED = "DAMAGED"
    UNREACHABLE = "UNREACHABLE"


@dataclass(frozen=True)
class Verdict:
    """What a check found. ``reason``: for a person, what was checked or what is wrong;
    ``manifest``: the checkpoint's, if one was read; ``nodes``: for UNREACHABLE from
    ``check``, the nodes on which a rank could not read it, in rank order."""

    kind: VerdictKind
    reason: str
    manifest: Manifest | None = None
    nodes: tuple[str, ...] = ()


class Expected(NamedTuple):
    """A file the checkpoint needs: ``name`` relative to its directory, ``size_bytes``
    and ``crc32`` from the manifest; ``crc32`` None: from DCP's metadata, a file at
    least ``size_bytes`` long, of unknown sum."""

    name: str
    size_bytes: int
    crc32: int | None


class Finding(NamedTuple):
    """What one process found wrong: a DAMAGED or UNREACHABLE ``kind`` and why."""

    kind: VerdictKind
    reason: str


@dataclass(frozen=True)
class Plan:
    """What to check of a checkpoint: ``expected``, sorted by name; ``manifest``, the
    one read (None: none, ``expected`` comes from ``.metadata``); ``passed``, the
    verdict if every expected file checks out."""

    expected: tuple[Expected, ...]
    manifest: Manifest | None
    passed: Verdict


def _why(error: OSError) -> str:
    name = errno.errorcode.get(error.errno, "") if error.errno else ""
    return f"{name} ({error.strerror})" if name else str(error)


def plan(path: str) -> Verdict | Plan:
    """What checking the checkpoint in ``path`` takes, or its verdict where the
    directory, its manifest or its ``.metadata`` already decide it (UNREACHABLE reasons
    say what could not be read, not where)."""
    try:
        os.listdir(path)
    except FileNotFoundError:
        return Verdict(VerdictKind.UNREACHABLE, "the directory is missing")
    except NotADirectoryError:
        return Verdict(VerdictKind.DAMAGED, "it is not a directory")
    except OSError as error:
        return Verdict(VerdictKind.UNREACHABLE, f"the directory cannot be read: {_why(error)}")
    try:
        found = manifest.read(path)
    except FileNotFoundError:
        return _plan_from_metadata(path)
    except MalformedManifest as error:
        return Verdict(VerdictKind.DAMAGED, f"its {MANIFEST_FILE} {error.problem}")
    except OSError as error:
        return Verdict(
            VerdictKind.UNREACHABLE, f"its {MANIFEST_FILE} cannot be read: {_why(error)}"
        )
    if METADATA_FILE not in found.files:
        return Verdict(VerdictKind.DAMAGED, f"its {MANIFEST_FILE} lists no {METADATA_FILE}", found)
    expected = tuple(
        Expected(name, entry.size_bytes, entry.crc32) for name, entry in sorted(found.files.items())
    )
    passed = Verdict(
        VerdictKind.OK,
        f"its {len(expected)} files ({found.size_bytes} bytes) match its {MANIFEST_FILE}",
        found,
    )
    return Plan(expected, found, passed)


def _plan_from_metadata(path: str) -> Verdict | Plan:
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return Verdict(VerdictKind.DAMAGED, f"it has neither {MANIFEST_FILE} nor {METADATA_FILE}")
    except OSError as error:
        return Verdict(
            VerdictKind.UNREACHABLE, f"its {METADATA_FILE} cannot be read: {_why(error)}"
        )
    except Exception as error:  # whatever unpickling damaged bytes raises
        return Verdict(
            VerdictKind.DAMAGED,
            f"its {METADATA_FILE} does not load: {type(error).__name__}: {error}",
        )
    needed: dict[str, int] = {}
    try:
        for piece in metadata.storage_data.values():
            end = piece.offset + piece.length
            needed[piece.relative_path] = max(needed.get(piece.relative_path, 0), end)
    except (AttributeError, TypeError) as error:
        return Verdict(
            VerdictKind.DAMAGED,
            f"its {METADATA_FILE} does not say where its tensors are: {type(error).__name__}",
        )
    expected = tuple(Expected(name, size, None) for name, size in sorted(needed.items()))
    passed = Verdict(
        VerdictKind.UNVERIFIED,
        f"it has no {MANIFEST_FILE}; its {METADATA_FILE} loads and the {len(expected)} files "
        "it names are there and long enough, but nothing proves their contents",
    )
    return Plan(expected, None, passed)


def _crc32_or_error(path: str) -> int | OSError:
    try:
        return manifest.crc32(path)
    except OSError as error:
        return error


def check_files(path: str, expected: Sequence[Expected]) -> Finding | None:
    """What is wrong with the files ``expected`` of the checkpoint in ``path`` (None:
    nothing): any proven damage (the first, in the order given) before any file that
    could not be read. Sizes first; then the sums, on up to ``manifest.CRC_THREADS``
    threads, of the files whose size is right."""
    damaged: list[str] = []
    unreadable: list[str] = []
    summed: list[Expected] = []
    for want in expected:
        try:
            found = os.stat(os.path.join(path, want.name))
        except FileNotFoundError:
            damaged.append(f"{want.name} is missing")
            continue
        except OSError as error:
            unreadable.append(f"{want.name} cannot be read: {_why(error)}")
            continue
        if not stat.S_ISREG(found.st_mode):
            damaged.append(f"{want.name} is not a file")
        elif want.crc32 is None:
            if found.st_size < want.size_bytes:
                damaged.append(
                    f"{want.name} has {found.st_size} bytes, {METADATA_FILE} needs "
                    f"at least {want.size_bytes}"
                )
        elif found.st_size != want.size_bytes:
            damaged.append(
                f"{want.name} has {found.st_size} bytes, the manifest says {want.size_bytes}"
            )
        else:
            summed.append(want)
    if damaged:
        return Finding(VerdictKind.DAMAGED, damaged[0])
    paths = [os.path.join(path, want.name) for want in summed]
    if len(paths) < 2 or manifest.CRC_THREADS < 2:
        sums = [_crc32_or_error(p) for p in paths]
    else:
        with ThreadPoolExecutor(max_workers=min(manifest.CRC_THREADS, len(paths))) as pool:
            sums = list(pool.map(_crc32_or_error, paths))
    for want, crc in zip(summed, sums):
        if isinstance(crc, OSError):
            unreadable.append(f"{want.name} cannot be read: {_why(crc)}")
        elif crc != want.crc32:
            damaged.append(f"{want.name} does not match its checksum")
    if damaged:
        return Finding(VerdictKind.DAMAGED, damaged[0])
    if unreadable:
        return Finding(VerdictKind.UNREACHABLE, unreadable[0])
    return None


def check_alone(path: str) -> Verdict:
    """The verdict on the checkpoint in ``path``, this process alone reading all of it:
    the reference rule that ``check`` splits between ranks."""
    planned = plan(path)
    if isinstance(planned, Verdict):
        if planned.kind is VerdictKind.UNREACHABLE:
            return replace(planned, reason=f"{planned.reason} on this node")
        return planned
    finding = check_files(path, planned.expected)
    if finding is None:
        return planned.passed
    where = " on this node" if finding.kind is VerdictKind.UNREACHABLE else ""
    return Verdict(finding.kind, finding.reason + where, planned.manifest)


def shares(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """The indices of ``sizes`` each of ``ranks`` ranks checks: the largest first, each
    to the rank with the fewest bytes so far (the lowest such rank on a tie), so the
    slowest rank reads little more than its part. Deterministic: every rank computes
    the same shares. Pure."""
    given: list[list[int]] = [[] for _ in range(ranks)]
    loads = [(0, rank) for rank in range(ranks)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        given[rank].append(index)
        heapq.heappush(loads, (load + sizes[index], rank))
    return [sorted(indices) for indices in given]


def combine(passed: Verdict, found: Sequence[tuple[str, Finding | None]]) -> Verdict:
    """The verdict of a check split between ranks, from each rank's ``(node, finding)``
    (by rank) and the verdict ``passed`` if no rank found anything: the lowest rank's
    damage, else UNREACHABLE naming the lowest rank that could not read and every node
    on which a rank could not, else ``passed``. Pure."""
    damaged = [
        (rank, node, f)
        for rank, (node, f) in enumerate(found)
        if f and f.kind is VerdictKind.DAMAGED
    ]
    if damaged:
        rank, node, finding = damaged[0]
        return Verdict(
            VerdictKind.DAMAGED,
            f"{finding.reason} (found by rank {rank} on {node})",
            passed.manifest,
        )
    unreachable = [(rank, node, f) for rank, (node, f) in enumerate(found) if f]
    if unreachable:
        rank, node, finding = unreachable[0]
        nodes = tuple(dict.fromkeys(node for _, node, _ in unreachable))
        also = (
            f"; {len(unreachable)} ranks on {len(nodes)} nodes could not"
            if len(unreachable) > 1
            else ""
        )
        return Verdict(
            VerdictKind.UNREACHABLE,
            f"{finding.reason} on {node} (rank {rank}{also})",
            passed.manifest,
            nodes,
        )
    return passed


def _check_share(path: str, planned: Plan, rank: int, ranks: int) -> Finding | None:
    """This rank's finding: whether its node sees the directory and rank 0's
    manifest, and then its share of the files."""
    try:
        os.listdir(path)
    except FileNotFoundError:
        return Finding(VerdictKind.UNREACHABLE, "the directory is missing")
    except OSError as error:
        return Finding(VerdictKind.UNREACHABLE, f"the directory cannot be read: {_why(error)}")
    if rank != 0:
        try:
            seen: Manifest | None = manifest.read(path)
        except FileNotFoundError:
            seen = None
        except MalformedManifest:
            return Finding(
                VerdictKind.UNREACHABLE, f"its {MANIFEST_FILE} differs from the one rank 0 read"
            )
        except OSError as error:
            return Finding(
                VerdictKind.UNREACHABLE, f"its {MANIFEST_FILE} cannot be read: {_why(error)}"
            )
        if seen != planned.manifest:
            return Finding(
                VerdictKind.UNREACHABLE, f"its {MANIFEST_FILE} differs from the one rank 0 read"
            )
    mine = shares([want.size_bytes for want in planned.expected], ranks)[rank]
    return check_files(path, [planned.expected[index] for index in mine])


def check(path: str, node: str = "") -> Verdict:
    """The verdict on the checkpoint in ``path``, the same on every rank, by
    ``check_alone``'s rule with the reading split between the ranks of the default
    process group. Collective: every rank calls it with the same ``path``. ``node``:
    this rank's node, as UNREACHABLE verdicts name it (default: the host name)."""
    node = node or socket.gethostname()
    rank, ranks = dist.get_rank(), dist.get_world_size()
    planned: list = [None]
    if rank == 0:
        decided = plan(path)
        if isinstance(decided, Verdict) and decided.kind is VerdictKind.UNREACHABLE:
            decided = combine(decided, [(node, Finding(decided.kind, decided.reason))])
        planned[0] = decided
    dist.broadcast_object_list(planned, src=0)
    decided = planned[0]
    if isinstance(decided, Verdict):
        return decided  # rank 0 alone decided it: from the directory, manifest or .metadata
    finding = _check_share(path, decided, rank, ranks)
    found: list = [None] * ranks
    dist.all_gather_object(found, (node, finding))
    return combine(decided.passed, found)
