"""Unix permission arithmetic for another user than this process's: whether a mode
lets that user read, write or pass, and what on a path stops it. Used where a process
prepares files for a user it is not (the agent for its rank user, ``keel up`` for
the one it runs ranks as)."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Callable
from pathlib import Path

READ, WRITE, SEARCH = 4, 2, 1  # the permission bits of one class (owner, group, other)


def allows(mode: int, owner: int, group: int, uid: int, gids: frozenset[int], want: int) -> bool:
    """Whether a user ``uid`` in groups ``gids`` (not root) has every bit of ``want``
    on a file of ``mode`` owned by ``owner``:``group``: the owner class if it owns it,
    else the group class if it is in the group, else the other class. Pure."""
    if uid == owner:
        bits = (mode >> 6) & 7
    elif group in gids:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def first_barrier(
    path: Path,
    uid: int,
    gids: frozenset[int],
    want: int,
    stat_of: Callable[[Path], os.stat_result] = os.stat,
) -> str | None:
    """Why user ``uid`` cannot get ``want`` on ``path``: the first directory on the way
    it may not pass, or the file itself, with its mode and owner; None if it can (or
    the path does not exist: it is then nobody's)."""
    path = Path(os.path.abspath(path))
    for step in [*reversed(path.parents), path]:
        try:
            info = stat_of(step)
        except FileNotFoundError:
            return None
        need = want if step == path else SEARCH
        if not allows(info.st_mode, info.st_uid, info.st_gid, uid, gids, need):
            return (
                f"{step} is mode {stat.S_IMODE(info.st_mode):04o} owned by "
                f"{_name(info.st_uid, pwd.getpwuid)}:{_name(info.st_gid, grp.getgrgid)}"
            )
    return None


def _name(number: int, look_up) -> str:
    try:
        return look_up(number)[0]
    except KeyError:
        return str(number)
