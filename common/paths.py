"""Whether a path lies inside a directory, as the processes that see the filesystem
(agents, ranks) judge it: symbolic links resolved."""

from __future__ import annotations

import os


def inside(path: str, directory: str | None) -> bool:
    """Whether ``path`` lies strictly inside ``directory`` (False without one); relative
    paths are taken from this process's working directory."""
    if not directory or "\0" in path:
        return False
    root = os.path.realpath(directory)
    resolved = os.path.realpath(path)
    return resolved != root and os.path.commonpath([root, resolved]) == root
