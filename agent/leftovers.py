"""What a dead agent left behind on its node, found and killed by the next one.

A rank dies with its agent (``common.launch``), but processes the rank started do not:
they are re-parented and keep running, holding GPU memory and ports. Every process of
a rank inherits ``KEEL_AGENT_SOCKET``, whose path is new for each agent incarnation, so
an agent records its own in ``RUN_DIR/agent.json`` and its successor on the same run
directory kills every process still carrying it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import structlog

from common import env
from common.procs import process_state

log = structlog.get_logger()

STATE_FILE = "agent.json"
KILL_WAIT_S = 5.0


class RunDirInUse(RuntimeError):
    """Another live agent owns this run directory."""


def carrying(*markers: str) -> list[int]:
    """PIDs of live processes (not zombies, not us) whose environment holds every one
    of ``markers`` ("NAME=value")."""
    needles = [b"\0" + m.encode() + b"\0" for m in markers]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = b"\0" + (entry / "environ").read_bytes()
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if all(n in environ for n in needles) and process_state(int(entry.name)) not in ("Z", None):
            found.append(int(entry.name))
    return found


def kill_marked(
    socket_path: str, job: str = "", generation: int = 0, spare: set[int] = frozenset()
) -> int:
    """SIGKILL every process started for the agent whose socket is ``socket_path`` (only
    those of ``job``'s ``generation`` if given), but the pids in ``spare`` (parked rank
    processes: their marks are from the environment they started with), and wait until
    they are gone; return how many there were."""
    markers = [f"{env.AGENT_SOCKET}={socket_path}"]
    if job:
        markers += [f"{env.JOB}={job}", f"{env.GENERATION}={generation}"]
    found = [pid for pid in carrying(*markers) if pid not in spare]
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left, deadline = found, time.monotonic() + KILL_WAIT_S
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in carrying(*markers) if pid not in spare]
    if left:
        log.error("processes survived SIGKILL", pids=left)
    return len(found)


def started_at(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22);
    None if there is no such process. A pid and its start time name one process: a
    pid alone may have been reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _previous(state_file: Path) -> dict | None:
    """The previous agent's record, or None if there is none that makes sense."""
    try:
        previous = json.loads(state_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    if (
        not isinstance(previous, dict)
        or not isinstance(previous.get("pid"), int)
        or not isinstance(previous.get("socket"), str)
    ):
        log.warning("ignoring a malformed agent record", path=str(state_file))
        return None
    return previous


def take_over(run_dir: Path, socket_path: str) -> int:
    """Kill what the previous agent on ``run_dir`` left running and record ours;
    return how many processes were killed. Raises RunDirInUse if that agent lives."""
    state_file = run_dir / STATE_FILE
    previous = _previous(state_file)
    killed = 0
    if previous:
        pid = previous["pid"]
        if (
            pid != os.getpid()
            and started_at(pid) is not None
            and started_at(pid) == previous.get("started")
        ):
            raise RunDirInUse(
                f"agent pid {pid} is running on run dir {run_dir}; "
                f"stop it or give this agent another --run-dir"
            )
        killed = kill_marked(previous["socket"])
        if killed:
            log.warning(
                "killed processes the previous agent left running",
                count=killed,
                previous_agent_pid=pid,
            )
    tmp = state_file.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"pid": os.getpid(), "started": started_at(os.getpid()), "socket": socket_path})
    )
    tmp.replace(state_file)
    return killed
