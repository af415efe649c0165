"""Rank processes: start them in their own process groups, watch them, stop them.

Stopping is a protocol: SIGTERM to the group, the generation's stop grace, SIGKILL to
the group, then the group is confirmed empty. A rank is started through ``common.launch`` so it
dies with the agent instead of outliving it.
"""

from __future__ import annotations

import enum
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from agent.env import rank_env
from agent.failure import error_file_traceback, stderr_traceback, tail
from agent.local_server import RankIdentity
from agent.pool import WarmPool
from common.deadlines import Deadlines
from common.procs import group_alive, signal_group, tied_to_this_process
from protos import keel_pb2

log = structlog.get_logger()



class RankPhase(str, enum.Enum):
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"   # SIGTERM sent, waiting out the grace
    KILLED = "KILLED"       # SIGKILL sent to the group
    EXITED = "EXITED"       # the rank's process was reaped
    REAPED = "REAPED"       # and its process group is empty


# The only transitions a rank makes; ``RankProcess.move`` refuses any other.
RANK_TRANSITIONS: dict[RankPhase, frozenset[RankPhase]] = {
    RankPhase.RUNNING: frozenset({RankPhase.STOPPING, RankPhase.EXITED}),
    RankPhase.STOPPING: frozenset({RankPhase.KILLED, RankPhase.EXITED}),
    RankPhase.KILLED: frozenset({RankPhase.EXITED}),
    RankPhase.EXITED: frozenset({RankPhase.REAPED}),
    RankPhase.REAPED: frozenset(),
}


class IllegalRankTransition(RuntimeError):
    pass


@dataclass(eq=False)
class RankProcess:
    job: str
    generation: int
    rank: int
    local_rank: int
    popen: subprocess.Popen
    log_dir: Path
    phase: RankPhase = RankPhase.RUNNING
    stop_requested_at: float = 0.0
    exited_at: float = 0.0
    last_step: int = 0
    started_at: float = field(default_factory=time.monotonic)
    stop_grace_s: float = 5.0      # SIGTERM to SIGKILL, the generation's
    exit_report: keel_pb2.RankExited | None = field(default=None)
    token: str = field(default="", repr=False)   # its credential on the agent's socket
    attached: bool = False         # it said it reports steps (AgentLocal.Attach)
    warm: bool = False             # started from a warm process (agent.pool)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def move(self, target: RankPhase, why: str) -> None:
        """Enter ``target`` (one line in the log); raises IllegalRankTransition if the
        lifecycle does not allow it."""
        if target not in RANK_TRANSITIONS[self.phase]:
            raise IllegalRankTransition(f"rank {self.rank} (pid {self.pid}) cannot go from "
                                        f"{self.phase.value} to {target.value}")
        log.info("rank phase", job=self.job, generation=self.generation, rank=self.rank,
                 pid=self.pid, **{"from": self.phase.value, "to": target.value}, why=why)
        self.phase = target

    @property
    def error_file(self) -> Path:
        return self.log_dir / f"rank{self.rank}.error.json"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / f"rank{self.rank}.err"


def rank_log(run_dir: Path, job: str, generation: int, rank: int, stream: str) -> Path:
    """Where a rank's ``out`` or ``err`` stream is written on its node."""
    return run_dir / job / f"gen{generation}" / f"rank{rank}.{stream}"


class Supervisor:
    def __init__(self, run_dir: Path, reap_timeout_s: float = 5.0, node: str = "",
                 interface: str = "", pool: WarmPool | None = None):
        """``interface``: where the ranks' gloo binds (GLOO_SOCKET_IFNAME), the one of
        the node's advertised address. ``pool``: warm processes to start ranks from."""
        self.run_dir = run_dir
        self.node = node
        self.interface = interface
        self.pool = pool
        self.reap_timeout_s = reap_timeout_s
        self.ranks: list[RankProcess] = []
        # Each rank's credential on the agent's socket, while it runs.
        self.identities: dict[str, RankIdentity] = {}

    def identify(self, token: str) -> RankIdentity | None:
        """Who presents ``token`` on the agent's socket: a rank this agent started and
        that has not exited, or None."""
        return self.identities.get(token)

    def start(self, start: keel_pb2.StartGeneration, agent_socket: str,
              chain: Deadlines) -> list[RankProcess]:
        """Start the ranks ``start`` assigns to this node, each stopped (when it comes to
        that) with the generation's stop grace from ``chain``."""
        log_dir = rank_log(self.run_dir, start.job, start.generation, 0, "out").parent
        log_dir.mkdir(parents=True, exist_ok=True)
        started = []
        for assignment in start.ranks:
            error_file = log_dir / f"rank{assignment.rank}.error.json"
            error_file.unlink(missing_ok=True)
            token = secrets.token_urlsafe(24)
            env = rank_env(os.environ, start, assignment, agent_socket, str(error_file), chain,
                           token, self.node, self.interface)
            out = rank_log(self.run_dir, start.job, start.generation, assignment.rank, "out")
            err = out.with_suffix(".err")
            popen = self._warm(start, assignment, env, out, err)
            warm = popen is not None
            if not warm:
                with open(out, "ab") as out_file, open(err, "ab") as err_file:
                    popen = subprocess.Popen(
                        [*tied_to_this_process(), *start.command],
                        env=env, stdout=out_file, stderr=err_file, stdin=subprocess.DEVNULL,
                        cwd=start.working_dir or None, start_new_session=True)
            proc = RankProcess(job=start.job, generation=start.generation,
                               rank=assignment.rank, local_rank=assignment.local_rank,
                               popen=popen, log_dir=log_dir, stop_grace_s=chain.stop_grace_s,
                               warm=warm)
            self.ranks.append(proc)
            self.identities[token] = RankIdentity(
                job=start.job, generation=start.generation,
                ranks=frozenset({assignment.rank}), checkpoint_dir=start.checkpoint_dir)
            proc.token = token
            started.append(proc)
            log.info("rank started", job=start.job, generation=start.generation,
                     rank=assignment.rank, warm=proc.warm, pid=popen.pid,
                     **({"warm_ready": self.pool.taken_ready} if warm else {}))
        return started

    def _warm(self, start: keel_pb2.StartGeneration, assignment: keel_pb2.RankAssignment,
              env: dict[str, str], out: Path, err: Path) -> subprocess.Popen | None:
        """A warm process become the rank, or None to start it cold."""
        if self.pool is None or start.cold_start:
            return None
        popen = self.pool.take(assignment.local_rank, list(start.command), dict(start.env),
                               time.monotonic())
        if popen is None:
            return None
        try:
            self.pool.hand(popen, list(start.command), env, start.working_dir, out, err)
        except OSError as exc:   # it died since it was checked
            log.warning("a warm process could not take its rank; starting it cold",
                        pid=popen.pid, error=str(exc))
            signal_group(popen.pid, signal.SIGKILL)
            return None
        return popen

    def of_generation(self, job: str, generation: int) -> list[RankProcess]:
        return [r for r in self.ranks if r.job == job and r.generation == generation]

    def stop(self, ranks: list[RankProcess], now: float) -> None:
        """Begin the stop protocol for ``ranks`` (SIGTERM to each running group)."""
        for proc in ranks:
            if proc.phase is RankPhase.RUNNING:
                proc.move(RankPhase.STOPPING, "SIGTERM to its process group")
                proc.stop_requested_at = now
                signal_group(proc.pid, signal.SIGTERM)

    def poll(self, now: float) -> list[RankProcess]:
        """Advance every rank's lifecycle; return ranks whose process just exited."""
        exited = []
        for proc in self.ranks:
            if proc.phase in (RankPhase.RUNNING, RankPhase.STOPPING, RankPhase.KILLED):
                code = proc.popen.poll()
                if code is not None:
                    stopped = proc.phase is not RankPhase.RUNNING
                    proc.move(RankPhase.EXITED, f"exit status {code}")
                    proc.exited_at = now
                    proc.exit_report = self._exit_report(proc, code, stopped)
                    self.identities.pop(proc.token, None)
                    # Whatever the rank left in its group (workers, helpers) goes with it.
                    signal_group(proc.pid, signal.SIGKILL)
                    exited.append(proc)
                elif (proc.phase is RankPhase.STOPPING
                      and now - proc.stop_requested_at >= proc.stop_grace_s):
                    log.warning("rank ignored SIGTERM; killing its process group",
                                rank=proc.rank, pid=proc.pid, grace_s=proc.stop_grace_s)
                    proc.move(RankPhase.KILLED, f"SIGTERM ignored for {proc.stop_grace_s:g} s")
                    signal_group(proc.pid, signal.SIGKILL)
            if proc.phase is RankPhase.EXITED:
                if not group_alive(proc.pid):
                    proc.move(RankPhase.REAPED, "its process group is empty")
                elif now - proc.exited_at > self.reap_timeout_s:
                    log.error("process group still has members after SIGKILL",
                              rank=proc.rank, pgid=proc.pid)
                    proc.move(RankPhase.REAPED, f"given up waiting {self.reap_timeout_s:g} s "
                                                f"for its process group")
        return exited

    def _exit_report(self, proc: RankProcess, code: int, stopped: bool) -> keel_pb2.RankExited:
        stderr_tail = tail(proc.stderr_path)
        traceback = error_file_traceback(proc.error_file) or stderr_traceback(stderr_tail)
        # Peers of a crashed rank die of its absence a moment later, often within one
        # poll; the error file's mtime dates an exception more precisely than the poll.
        exited_at = time.time()
        try:
            exited_at = min(exited_at, proc.error_file.stat().st_mtime)
        except FileNotFoundError:
            pass
        return keel_pb2.RankExited(
            job=proc.job, generation=proc.generation, rank=proc.rank, pid=proc.pid,
            exit_code=code if code >= 0 else -1, signal=-code if code < 0 else 0,
            traceback=traceback, stderr_tail=stderr_tail[-4000:], exited_at=exited_at,
            stopped_by_agent=stopped, last_step=proc.last_step, reaped_at=time.time())

    def generation_done(self, job: str, generation: int) -> bool:
        """True when every rank of the generation is reaped, its group empty."""
        return all(r.phase is RankPhase.REAPED for r in self.of_generation(job, generation))

    def forget(self, job: str, generation: int) -> None:
        self.ranks = [r for r in self.ranks
                      if not (r.job == job and r.generation == generation)]

    def stop_all(self, timeout_s: float) -> None:
        """Blocking stop of every rank, for agent shutdown."""
        self.stop(self.ranks, time.monotonic())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll(time.monotonic())
            if all(r.phase is RankPhase.REAPED for r in self.ranks):
                return
            time.sleep(0.05)
        for proc in self.ranks:
            signal_group(proc.pid, signal.SIGKILL)
