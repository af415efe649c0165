"""A checkpoint's manifest: every file it holds, with its size and CRC-32, written by
the commit before the rename, so a restore can tell a complete checkpoint from one that
was torn, truncated or damaged since (``verify``).

``manifest.json``: ``{"step": N, "files": {"<relative path>": {"bytes": B, "crc32": C}}}``.
CRC-32 (zlib's) catches torn and corrupted files; it is not meant to stop tampering.
The files are checksummed on up to ``CRC_THREADS`` threads at once (zlib releases the
GIL while it sums), since one core sums slower than a disk reads: a checkpoint of one
shard per rank is read back at the disk's pace rather than one core's.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 1 << 20
CRC_THREADS = min(8, os.cpu_count() or 1)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _crc32s(paths: list[str]) -> list[int]:
    """Each file's CRC-32, summed in parallel."""
    if len(paths) < 2 or CRC_THREADS < 2:
        return [_crc32(path) for path in paths]
    with ThreadPoolExecutor(max_workers=min(CRC_THREADS, len(paths))) as pool:
        return list(pool.map(_crc32, paths))


def _files(directory: str) -> list[str]:
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST_FILE:
                found.append(relative)
    return sorted(found)


def write(directory: str, step: int) -> int:
    """Write ``directory``'s manifest (fsynced); return the bytes of the files it lists."""
    names = _files(directory)
    sums = _crc32s([os.path.join(directory, name) for name in names])
    files = {
        name: {"bytes": os.path.getsize(os.path.join(directory, name)), "crc32": crc}
        for name, crc in zip(names, sums)
    }
    path = os.path.join(directory, MANIFEST_FILE)
    with open(path, "w") as out:
        json.dump({"step": step, "files": files}, out)
        out.flush()
        os.fsync(out.fileno())
    return sum(f["bytes"] for f in files.values())


def verify(directory: str) -> str:
    """Why the checkpoint in ``directory`` cannot be trusted, or "" if every file of its
    manifest is there, of its size and CRC."""
    if not os.path.isdir(directory):
        return "the directory is missing"
    try:
        with open(os.path.join(directory, MANIFEST_FILE)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST_FILE}"
    except (ValueError, KeyError, TypeError):
        return f"its {MANIFEST_FILE} is unreadable"
    listed = sorted(files.items())
    for name, expected in listed:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, the manifest says {expected['bytes']}"
    sums = _crc32s([os.path.join(directory, name) for name, _ in listed])
    for (name, expected), crc in zip(listed, sums):
        if crc != expected["crc32"]:
            return f"{name} does not match its checksum"
    return ""
