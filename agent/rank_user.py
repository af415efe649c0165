"""Ranks under their own user (``keel agent --rank-user USER``): a job's code runs with
another uid and gid than the agent's, and can reach only what it is given.

What a rank may touch: its generation's directory (``RUN_DIR/JOB/genN``, owned by the
rank user: its output files, its error file), the warm pool's directory, and the
agent's socket (its directory and the socket are the rank group's, 0710 and 0660: the
per-rank token in its environment is what authenticates it). The run directory itself
is 0711 (passable, not listable), and what the agent keeps in it is its own. Nothing
the agent reads as a credential (its token file, TLS key, etcd key), nor any other
key or token of its TLS directory (the CA's, the operator's), may be readable by the
rank user: the agent refuses to start until it is not, naming the file and the fix.
The agent makes itself non-dumpable (``PR_SET_DUMPABLE`` 0), so no other uid reads
``/proc/AGENT/environ`` (which holds e.g. the etcd password) or ptraces it.

The agent must run as root to do this; it needs no more of root than CAP_SETUID and
CAP_SETGID (``common.launch`` becomes the rank user), CAP_CHOWN (the rank's files),
CAP_KILL (signals to the ranks), CAP_DAC_OVERRIDE (the ranks' files and directories:
their logs read, their error files replaced) and CAP_SYS_PTRACE (``/proc/RANK/environ``,
read to find what a dead agent's ranks left running): the deploy recipes bound it to
those.
"""

from __future__ import annotations

import ctypes
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.permissions import READ, SEARCH, first_barrier

PR_SET_DUMPABLE = 4


class RankUserRefused(RuntimeError):
    """The agent cannot run ranks as the rank user as it is set up; says how to fix it."""


@dataclass(frozen=True)
class RankUser:
    """The user ranks run as: its name, uid, primary gid and home."""

    name: str
    uid: int
    gid: int
    home: str = "/"

    @classmethod
    def lookup(cls, name: str) -> RankUser:
        """The user ``name`` (or a numeric uid) of this machine; ValueError with the fix
        if there is none or it is root."""
        try:
            entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError:
            raise ValueError(
                f"--rank-user {name}: no such user on this machine; create it "
                f"(useradd --system --no-create-home --shell /usr/sbin/nologin {name})"
            ) from None
        if entry.pw_uid == 0:
            raise ValueError(f"--rank-user {name}: ranks may not run as root")
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/")

    @property
    def ids(self) -> tuple[int, int]:
        """(uid, gid): what ``common.procs.tied_to_this_process`` starts a process as
        (its primary group, no supplementary groups: none of the agent's)."""
        return self.uid, self.gid

    def env(self) -> dict[str, str]:
        """What a login as this user would set: its home, for the caches that libraries
        keep there (the agent's home is not the rank's to write)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def groups(self) -> frozenset[int]:
        return frozenset({self.gid})

    def give(self, path: Path, mode: int) -> None:
        """Make ``path`` this user's, with ``mode`` (set first: changing the mode of a
        file one does not own takes CAP_FOWNER, which the agent need not hold)."""
        os.chmod(path, mode)
        os.chown(path, self.uid, self.gid)


def exposed(
    user: RankUser,
    secrets: tuple[Path, ...],
    stat_of: Callable[[Path], os.stat_result] = os.stat,
) -> list[str]:
    """A line per file of ``secrets`` that ``user`` can read, saying how to close it."""
    found = []
    for path in secrets:
        try:
            stat_of(Path(path))
        except FileNotFoundError:
            continue
        if first_barrier(Path(path), user.uid, user.groups(), READ, stat_of) is None:
            found.append(
                f"the rank user {user.name} can read {path}; make it the agent's alone "
                f"(chmod 600 {path}, or chmod 700 its directory)"
            )
    return found


def unreachable(
    user: RankUser, run_dir: Path, stat_of: Callable[[Path], os.stat_result] = os.stat
) -> str | None:
    """Why ``user`` cannot reach ``run_dir`` (where its rank directories are), with the
    fix; None if it can pass every directory above it."""
    barrier = first_barrier(run_dir.parent, user.uid, user.groups(), SEARCH, stat_of)
    if barrier is None:
        return None
    return (
        f"the rank user {user.name} cannot reach --run-dir {run_dir}: {barrier}; let it "
        f"pass (chmod o+x that directory) or choose a run directory it can reach"
    )


def check(user: RankUser, run_dir: Path, secrets: tuple[Path, ...]) -> None:
    """Raise RankUserRefused, naming every problem and its fix, unless this process
    can start processes as ``user``, ``user`` reaches ``run_dir`` and reads none of
    ``secrets``."""
    problems = []
    if os.geteuid() != 0:
        problems.append(
            f"--rank-user {user.name} needs the agent to run as root (it starts the "
            f"ranks as that user); run it as root or without --rank-user"
        )
    problems += exposed(user, secrets)
    barrier = unreachable(user, run_dir)
    if barrier:
        problems.append(barrier)
    if problems:
        raise RankUserRefused("; ".join(problems))


def make_undumpable() -> None:
    """Close this process's ``/proc/PID/environ``, memory and ptrace to other uids
    (its ``/proc/PID`` files become root's)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
