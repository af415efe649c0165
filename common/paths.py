"""Paths as every process handles them: whether one lies inside a directory, as the
processes that see the filesystem (agents, ranks) judge it (symbolic links resolved),
and files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def inside(path: str, directory: str | None) -> bool:
    """Whether ``path`` lies strictly inside ``directory`` (False without one); relative
    paths are taken from this process's working directory."""
    if not directory or "\0" in path:
        return False
    root = os.path.realpath(directory)
    resolved = os.path.realpath(path)
    return resolved != root and os.path.commonpath([root, resolved]) == root


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new
    one (a daemon publishing its address, say), never a part."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
