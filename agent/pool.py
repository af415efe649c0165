"""Warm processes: per slot, a process that has already started Python and imported
torch (``agent.warm``) waits to become a rank, so a generation's ranks start without
paying for either (most of a cold start: docs/BENCHMARKS.md, recovery).

A rank whose command is this agent's interpreter running a script or ``-m`` module
(``python -u X`` as ``keel run`` and ``keel up`` give it) takes one; any other command,
a job that opted out (``JobSpec.cold_start``), or one that sets
``CUDA_VISIBLE_DEVICES`` (the context is made already) starts cold. A pool process
that died, or is older than ``max_age_s``, is replaced, never handed out. The pool is
filled when the agent starts and refilled right after one is taken (``eager``, the
default): a job's first generation and a failure seconds after any start find their
processes ready (or importing, ahead of a cold start). ``lazy`` fills it only once
ranks have started here and then run for ``refill_delay_s`` (a refill costs what a
cold start does, CPU beside a generation that is starting; a node that runs nothing,
or a generation that ends sooner, is not charged for one): a job's first generation
starts cold, and the restarts after it warm. That is for small machines, and the test
suite's.

A warm process says on a pipe when its imports are done; the agent logs it (``warm
process ready``). One still importing is handed out all the same (it is ahead of a
cold start), and the agent's ``rank started`` line says ``warm_ready=false``. A pool
process that is stopped (SIGSTOP: a stalled process would stall its rank) counts as
dead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from agent.rank_user import RankUser
from agent.warm import DEFAULT_IMPORTS, SLOT
from common import env as keel_env
from common.procs import process_state, signal_group, tied_to_this_process

log = structlog.get_logger()

MAX_AGE_S = 3600.0
# Taken processes are replaced once the generation that took them has run this long:
# refilling costs what a cold start would (Python and torch again), so a generation
# that ends sooner (a job done, a failure right after a start) is not charged for it.
# A failure within it restarts cold.
REFILL_DELAY_S = 10.0


@dataclass
class _Warm:
    popen: subprocess.Popen
    slot: int
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when it said its imports were done

    def check_ready(self, now: float) -> bool:
        """Whether it has said (on its stdout pipe) that its imports are done."""
        if self.ready_at is None:
            try:
                said = os.read(self.popen.stdout.fileno(), 64)
            except (BlockingIOError, OSError, ValueError):
                said = b""
            if b"ready" in said:
                self.ready_at = now
                log.info(
                    "warm process ready",
                    slot=self.slot,
                    pid=self.popen.pid,
                    after_s=round(now - self.started_at, 2),
                )
        return self.ready_at is not None


def warm_args(command: list[str]) -> list[str] | None:
    """What follows the interpreter in ``command`` if a warm process can run it (this
    interpreter, at most ``-u``, then a script or ``-m MODULE``), else None. A warm
    rank runs unbuffered (``-u``) either way."""
    # The same path, not the same binary: another virtual environment's python links
    # to the same interpreter but imports other packages.
    found = shutil.which(command[0]) if command else None
    if found is None or os.path.abspath(found) != os.path.abspath(sys.executable):
        return None
    rest = command[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if rest[:1] == ["-m"]:
        return rest if len(rest) > 1 and not rest[1].startswith("-") else None
    return rest if rest and not rest[0].startswith("-") else None


class WarmPool:
    def __init__(
        self,
        slots: int,
        log_dir: Path,
        base_env: dict[str, str],
        max_age_s: float = MAX_AGE_S,
        refill_delay_s: float = REFILL_DELAY_S,
        imports: tuple[str, ...] = DEFAULT_IMPORTS,
        rank_user: RankUser | None = None,
        eager: bool = True,
    ):
        """``slots`` processes at most, one per local rank; each starts with
        ``base_env`` (the agent's, no KEEL_* but the socket that marks what this agent
        started) and logs to ``log_dir`` until it is given a rank. With ``rank_user``
        they run as that user (``agent.rank_user``), and ``log_dir`` is theirs.
        ``eager``: filled from the start and right after each take, else lazily."""
        self.eager = eager
        self.rank_user = rank_user
        self.slots = slots
        self.log_dir = log_dir
        self.base_env = base_env
        self.max_age_s = max_age_s
        self.refill_delay_s = refill_delay_s
        self.imports = imports
        self.idle: dict[int, _Warm] = {}
        # None until a rank starts here: a node that runs nothing costs nothing.
        self.last_taken: float | None = None
        # Whether the process ``take`` last returned had finished its imports.
        self.taken_ready = False

    def _spawn(self, slot: int) -> _Warm:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        user_env = {}
        if self.rank_user is not None:
            self.rank_user.give(self.log_dir, 0o700)
            user_env = self.rank_user.env()
        # Its argument names its pool in `ps` (and for whoever looks for what an agent
        # left running): a rank it becomes keeps this command line.
        # Its stdout is a pipe until it becomes a rank: "ready" once imported.
        with open(self.log_dir / f"slot{slot}.log", "ab") as out:
            popen = subprocess.Popen(
                [
                    *tied_to_this_process(self.rank_user.ids if self.rank_user else None),
                    sys.executable,
                    "-u",
                    "-m",
                    "agent.warm",
                    str(self.log_dir / f"slot{slot}"),
                    ",".join(self.imports),
                ],
                env={**self.base_env, **user_env, SLOT: str(slot)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                start_new_session=True,
            )
        os.set_blocking(popen.stdout.fileno(), False)
        return _Warm(popen, slot)

    def _usable(self, warm: _Warm, now: float) -> bool:
        # Stopped (T) or traced (t): it would stall the rank it became.
        return (
            warm.popen.poll() is None
            and now - warm.started_at < self.max_age_s
            and process_state(warm.popen.pid) not in ("T", "t", None)
        )

    def refill(self, now: float) -> None:
        """Replace dead and stale processes, and once ranks have not been started for
        a while, the taken ones."""
        for slot, warm in list(self.idle.items()):
            if not self._usable(warm, now):
                log.info(
                    "replacing a warm process",
                    slot=slot,
                    pid=warm.popen.pid,
                    exit_code=warm.popen.poll(),
                    state=process_state(warm.popen.pid),
                )
                _discard(warm)
                del self.idle[slot]
            else:
                warm.check_ready(now)
        if not self.eager and (
            self.last_taken is None or now - self.last_taken < self.refill_delay_s
        ):
            return
        for slot in range(self.slots):
            if slot not in self.idle:
                self.idle[slot] = self._spawn(slot)

    def take(
        self, slot: int, command: list[str], job_env: dict[str, str], now: float
    ) -> subprocess.Popen | None:
        """The warm process of ``slot`` if it can run ``command`` (and is alive and
        fresh), removed from the pool; else None, and the rank starts cold."""
        self.last_taken = now
        if warm_args(command) is None or "CUDA_VISIBLE_DEVICES" in job_env:
            return None
        warm = self.idle.pop(slot, None)
        if warm is None:
            return None
        if not self._usable(warm, now):
            log.info(
                "not handing out a warm process",
                slot=slot,
                pid=warm.popen.pid,
                exit_code=warm.popen.poll(),
                state=process_state(warm.popen.pid),
            )
            _discard(warm)
            return None
        self.taken_ready = warm.check_ready(now)
        return warm.popen

    @staticmethod
    def hand(
        popen: subprocess.Popen,
        command: list[str],
        env: dict[str, str],
        cwd: str,
        stdout: Path,
        stderr: Path,
    ) -> None:
        """Give ``popen`` (from ``take``) its rank; raises OSError if it died since."""
        assignment = {
            "args": warm_args(command),
            "env": env,
            "cwd": cwd,
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        popen.stdin.write(json.dumps(assignment).encode() + b"\n")
        popen.stdin.close()
        popen.stdout.close()  # it writes the rank's file from now on

    def close(self) -> None:
        for warm in self.idle.values():
            _discard(warm)
        self.idle.clear()


def _discard(warm: _Warm) -> None:
    signal_group(warm.popen.pid, signal.SIGKILL)
    try:
        warm.popen.wait(5)
    except subprocess.TimeoutExpired:
        pass
    for pipe in (warm.popen.stdin, warm.popen.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


def pool_env(base: dict[str, str], agent_socket: str) -> dict[str, str]:
    """A warm process's environment before its rank's: the agent's without its Keel
    settings and secrets, but with the socket that marks this agent's processes
    (agent.leftovers)."""
    env = {k: v for k, v in base.items() if not k.startswith("KEEL_")}
    env[keel_env.AGENT_SOCKET] = agent_socket
    return env
