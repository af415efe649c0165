"""Processes and their groups: start a child that dies with its parent, signal and
probe a process group, stop processes with a grace period and confirm they are gone.

Shutdown is a protocol (SIGTERM, a grace, SIGKILL to the process group, confirm the
group is empty); ``terminate`` runs it for a list of processes at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

REAP_WAIT_S = 5.0  # after SIGKILL, how long a process group may take to empty


def tied_to_this_process(as_user: tuple[int, int] | None = None) -> list[str]:
    """Argv prefix that runs a command so the kernel SIGKILLs it when this process dies
    (``python -m common.launch PID CMD...``; see that module for why it is a program),
    as ``as_user`` (uid, gid) if given."""
    user = ["--as", f"{as_user[0]}:{as_user[1]}"] if as_user else []
    return [sys.executable, "-m", "common.launch", str(os.getpid()), *user]


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is left (zombies count until
    reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/PID/stat`` (R, S, D, T for stopped, Z ...),
    or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return None


def process_wchan(pid: int) -> str:
    """The kernel function ``pid`` waits in (``/proc/PID/wchan``: e.g.
    ``request_wait_answer`` for a FUSE request that is not answered), or "" if it is
    not waiting, is gone, or the kernel does not say."""
    try:
        with open(f"/proc/{pid}/wchan") as wchan:
            name = wchan.read().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return "" if name == "0" else name


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``, from ``/proc``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone is no error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def terminate(procs: Sequence[subprocess.Popen], grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Stop ``procs``, each the leader of its own process group (started with
    ``start_new_session=True``): ``sig`` (SIGTERM) to each process, up to ``grace_s``
    seconds for all of them to exit, then SIGKILL to the groups of those left, and wait
    until every group is empty (at most ``REAP_WAIT_S`` more)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    # What a process left in its group (children it started) goes too.
    for proc in procs:
        signal_group(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + REAP_WAIT_S
    while any(group_alive(proc.pid) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, theirs, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def poll(condition, timeout_s: float, period_s: float = 0.05):
    """Call ``condition()`` every ``period_s`` until it returns something truthy, and
    return that; None once ``timeout_s`` passed without."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(period_s)
    return None
