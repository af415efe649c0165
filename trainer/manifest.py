"""A checkpoint's manifest: every file it holds, with its size and CRC-32, and who wrote
it (the job, its lineage, the generation), written by the commit before the rename so
that a restore can tell a complete checkpoint from one that was torn, truncated or
damaged since (``trainer.verify``), and whose checkpoint it is.

``manifest.json`` (schema 2)::

    {"schema": 2, "step": N, "job_id": "...", "job": "...", "lineage": ["<origin id>",
     ..., "<this job's id>"], "generation": G,
     "files": {"<relative path>": {"bytes": B, "crc32": C}}}

Schema 1, written before manifests named their owner, is ``{"step", "files"}`` alone;
it still parses, with the owner fields empty. ``Manifest`` is the record; ``read`` and
``write`` are the only code that touches the file.

The sums are not read back from the files: every rank computes those of the files it
writes as DCP writes them (``trainer.summing_writer``), and the commit writes them here;
only small files of rank 0's own (``ledger.json``) are read for their sums
(``checksum``). CRC-32 (zlib's) catches torn and corrupted files; it is not meant to
stop tampering. Files are read back for their sums on up to ``CRC_THREADS`` threads at
once (zlib releases the GIL while it sums), since one core sums slower than a disk reads.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, NamedTuple

import msgspec

MANIFEST_FILE = "manifest.json"
SCHEMA = 2
CHUNK_BYTES = 1 << 20
CRC_THREADS = min(8, os.cpu_count() or 1)


class FileSum(NamedTuple):
    """One file's ``size_bytes`` and CRC-32 (zlib's, of all its bytes)."""

    size_bytes: int
    crc32: int


class MalformedManifest(ValueError):
    """A manifest whose content does not parse: proof that the checkpoint is damaged.
    ``problem``: what is wrong with it, as a phrase ("does not parse: ...")."""

    def __init__(self, source: str, problem: str):
        super().__init__(f"{source} {problem}")
        self.problem = problem


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds and who wrote it. ``step``: the checkpoint's step;
    ``files``: relative path → its ``FileSum``, every file but the manifest; ``job_id``
    and ``job``: the writing job's unique id and name ("" outside Keel, or in a schema-1
    manifest); ``lineage``: the job ids whose checkpoints this one continues, origin
    first, the writing job last (() likewise); ``generation``: the writing generation
    (0 outside Keel, or in schema 1)."""

    step: int
    files: Mapping[str, FileSum]
    job_id: str = ""
    job: str = ""
    lineage: tuple[str, ...] = ()
    generation: int = 0
    # The stored form's version this record was read from (SCHEMA when built here).
    schema: int = field(default=SCHEMA, compare=False)

    @property
    def size_bytes(self) -> int:
        """The bytes of every file it lists."""
        return sum(entry.size_bytes for entry in self.files.values())

    def to_json(self) -> str:
        """Its stored form, always of the current schema."""
        stored = _Stored(
            schema=SCHEMA,
            step=self.step,
            job_id=self.job_id,
            job=self.job,
            lineage=list(self.lineage),
            generation=self.generation,
            files={
                name: _StoredFile(size_bytes=entry.size_bytes, crc32=entry.crc32)
                for name, entry in sorted(self.files.items())
            },
        )
        return _ENCODER.encode(stored).decode()

    @classmethod
    def parse(cls, raw: bytes | str, source: str = MANIFEST_FILE) -> Manifest:
        """The manifest stored as ``raw``; raises MalformedManifest naming ``source``
        and what is wrong."""
        try:
            stored = _DECODER.decode(raw)
        except msgspec.DecodeError as exc:  # not JSON, or a field of the wrong type
            raise MalformedManifest(source, f"does not parse: {exc}") from None
        if stored.schema not in (1, SCHEMA):
            raise MalformedManifest(
                source, f"is of schema {stored.schema}; this version reads 1 and {SCHEMA}"
            )
        for name in stored.files:
            if _outside(name):
                raise MalformedManifest(
                    source, f"lists {name!r}, which is not a file inside its directory"
                )
        return cls(
            step=stored.step,
            files={
                name: FileSum(entry.size_bytes, entry.crc32) for name, entry in stored.files.items()
            },
            job_id=stored.job_id,
            job=stored.job,
            lineage=tuple(stored.lineage),
            generation=stored.generation,
            schema=stored.schema,
        )


_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _StoredFile(msgspec.Struct):
    size_bytes: _NonNegative = msgspec.field(name="bytes")
    crc32: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class _Stored(msgspec.Struct, kw_only=True):
    schema: int = 1  # schema-1 manifests carry no version
    step: _NonNegative
    job_id: str = ""
    job: str = ""
    lineage: list[str] = msgspec.field(default_factory=list)
    generation: _NonNegative = 0
    files: dict[str, _StoredFile]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(_Stored)


def _outside(name: str) -> bool:
    """Whether ``name`` is not a plain relative path of a file below the directory
    (absolute, climbing out, not normalized, or the manifest itself)."""
    return (
        not name
        or os.path.isabs(name)
        or os.path.normpath(name) != name
        or name.split(os.sep)[0] == os.pardir
        or name == MANIFEST_FILE
    )


def read(directory: str) -> Manifest:
    """The manifest of the checkpoint in ``directory``. Raises FileNotFoundError if it
    has none (or ``directory`` is missing), another OSError if the file cannot be read
    (permissions, I/O: a problem of this node, not of the checkpoint), and
    MalformedManifest if its content does not parse."""
    path = os.path.join(directory, MANIFEST_FILE)
    with open(path, "rb") as f:
        raw = f.read()
    return Manifest.parse(raw, path)


def write(directory: str, manifest: Manifest) -> None:
    """Writes ``manifest`` into ``directory`` as its ``manifest.json``, fsynced (not its
    directory entry: the commit fsyncs the directory). Raises ValueError, writing
    nothing, if the directory holds a file that the manifest does not list: a manifest
    says what every file of its checkpoint should be."""
    unlisted = sorted(set(_files(directory)) - set(manifest.files))
    if unlisted:
        raise ValueError(
            f"the manifest of {directory} would leave {', '.join(unlisted)} without a checksum"
        )
    with open(os.path.join(directory, MANIFEST_FILE), "w") as out:
        out.write(manifest.to_json())
        out.flush()
        os.fsync(out.fileno())


def checksum(directory: str, names: Iterable[str]) -> dict[str, FileSum]:
    """The sums of the files ``names`` (relative to ``directory``), read back: for small
    files only (``ledger.json``); what DCP writes is summed as it is written."""
    names = sorted(names)
    paths = [os.path.join(directory, name) for name in names]
    return {
        name: FileSum(os.path.getsize(path), crc)
        for name, path, crc in zip(names, paths, crc32s(paths))
    }


def crc32(path: str) -> int:
    """The CRC-32 of the file at ``path``, read in ``CHUNK_BYTES`` pieces."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def crc32s(paths: list[str]) -> list[int]:
    """Each file's CRC-32, summed in parallel; the first error raises."""
    if len(paths) < 2 or CRC_THREADS < 2:
        return [crc32(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(CRC_THREADS, len(paths))) as pool:
        return list(pool.map(crc32, paths))


def _files(directory: str) -> list[str]:
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST_FILE:
                found.append(relative)
    return sorted(found)
