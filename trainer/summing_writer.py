"""DCP's file writer, summing what it writes: every rank computes the size and CRC-32
of each file as its bytes pass to the disk, so the commit's manifest
(``trainer.manifest``) needs no reading back of a checkpoint that was just written.

``SummingWriter`` is DCP's ``FileSystemWriter`` (``sync_files=True``: every file is
fsynced before its rank's write is done, as before) over a filesystem whose write
streams sum what passes through them. Each rank's sums travel to the coordinator with
its write results, the one gather DCP already makes: a result of their own, under an
index no state dict holds, which the coordinator takes out before DCP builds its
``.metadata`` from the rest, so the metadata is DCP's own and loads without Keel. The
coordinator's ``sums`` then holds every file of the checkpoint, ``.metadata`` too
(written through the same streams).

Why the write results and not a file of sums per rank in the checkpoint directory:
the sums then cost no extra file, fsync or cleanup on any rank, and arrive exactly when
DCP's coordinator learns that every rank's files are written and fsynced; a crash
leaves nothing of them behind. DCP's ``StorageWriter`` protocol promises that every
rank's ``write_data`` results reach the coordinator's ``finish``.

A stream only ever appends (DCP writes each file front to back; it has no ``seek``), so
its running CRC is the file's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Iterator

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainer.manifest import FileSum

# The index of the write result that carries a rank's sums: no state dict key.
_SUMS = MetadataIndex(fqn="keel.summing_writer.sums")


class _SummingStream:
    """A file open for writing that sums the bytes written through it."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.size_bytes = 0
        self.crc32 = 0

    def write(self, data) -> int:
        self.crc32 = zlib.crc32(data, self.crc32)
        written = self._raw.write(data)
        self.size_bytes += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed


class _SummingFileSystem(FileSystem):
    """DCP's local filesystem; ``sums``: path → ``FileSum`` of every file written (and
    closed without an error) through it, under its current name."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSum] = {}
        self._lock = threading.Lock()  # DCP may write several files at once, on threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if mode == "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if mode != "wb":
            # A file appended to or rewritten in place could not be summed in one pass.
            raise ValueError(f"cannot sum a file opened with mode {mode!r}")
        with open(path, "wb") as raw:
            stream = _SummingStream(raw)
            yield stream
        with self._lock:
            self.sums[os.fspath(path)] = FileSum(stream.size_bytes, stream.crc32)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if os.fspath(path) in self.sums:
                self.sums[os.fspath(new_path)] = self.sums.pop(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        with self._lock:
            self.sums.pop(os.fspath(path), None)


class SummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` into the directory ``path`` (one per save) that sums
    every file it writes. After the save, the coordinator's ``sums`` maps each file of
    the checkpoint (relative path) to its ``FileSum``; on other ranks it stays empty."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, sync_files=True)
        self.fs = _SummingFileSystem()
        self.sums: dict[str, FileSum] = {}

    def _relative(self, sums: dict[str, FileSum]) -> dict[str, FileSum]:
        return {os.path.relpath(path, self.path): entry for path, entry in sums.items()}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        with self.fs._lock:
            mine = self._relative(self.fs.sums)
        summed: Future[list[WriteResult]] = Future()
        summed.set_result([*results, WriteResult(index=_SUMS, size_in_bytes=0, storage_data=mine)])
        return summed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        sums: dict[str, FileSum] = {}
        written = []
        for rank_results in results:
            written.append([result for result in rank_results if result.index != _SUMS])
            for result in rank_results:
                if result.index == _SUMS:
                    sums.update(result.storage_data)
        super().finish(metadata, written)
        with self.fs._lock:
            # .metadata, which DCP wrote through our streams just now.
            mine = self._relative(self.fs.sums)
        self.sums = sums | mine
