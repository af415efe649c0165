"""Rank processes: start them in their own process groups, watch them, stop them.

Stopping is a protocol: SIGTERM to the group, the generation's stop grace, SIGKILL to
the group, then the group is confirmed empty. A rank that SIGKILL does not end within
the reap wait (stuck in the kernel: uninterruptible I/O on a hung mount, a driver) is
named with its group's processes, their state and wait channel (``RankProcess.stuck``):
its node cannot confirm the stop, and the controller says why when the stop deadline
passes. A rank is started through ``common.launch`` so it
dies with the agent instead of outliving it.

A rank that attached with restart in place (``trainer.runtime``) is first asked to
leave its generation alive (LEAVING, for at most ``PARK_WINDOW_S``); one that parks in
that time (``agent.parking``) is done for the generation and may become a rank of the
next; one that does not is stopped as above. A new generation's rank is, in order of
preference, a parked process of its slot, a warm one (``agent.pool``), or a new one.
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
from agent.memory import JobMemory
from agent.parking import Parked, ParkingLot
from agent.pool import WarmPool
from agent.rank_user import RankUser
from common.deadlines import Deadlines
from common.procs import (
    REAP_WAIT_S,
    group_alive,
    group_members,
    process_state,
    process_wchan,
    signal_group,
    tied_to_this_process,
)
from protos import keel_pb2

log = structlog.get_logger()

# How long a rank that can restart in place has, once its generation is stopped, to
# leave it alive before it is stopped like any other. A rank whose peer died gets its
# collective's error within a fraction of a second; one blocked on a stalled peer
# never does, and is not kept waiting long.
PARK_WINDOW_S = 2.0


class RankPhase(str, enum.Enum):
    RUNNING = "RUNNING"
    LEAVING = "LEAVING"  # asked to leave the generation alive (restart in place)
    PARKED = "PARKED"  # it did: done for the generation, its process kept (agent.parking)
    STOPPING = "STOPPING"  # SIGTERM sent, waiting out the grace
    KILLED = "KILLED"  # SIGKILL sent to the group
    EXITED = "EXITED"  # the rank's process was reaped
    REAPED = "REAPED"  # and its process group is empty


# The only transitions a rank makes; ``RankProcess.move`` refuses any other.
RANK_TRANSITIONS: dict[RankPhase, frozenset[RankPhase]] = {
    RankPhase.RUNNING: frozenset(
        {RankPhase.LEAVING, RankPhase.PARKED, RankPhase.STOPPING, RankPhase.EXITED}
    ),
    RankPhase.LEAVING: frozenset({RankPhase.PARKED, RankPhase.STOPPING, RankPhase.EXITED}),
    RankPhase.PARKED: frozenset(),
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
    killed_at: float = 0.0  # SIGKILL sent to its group
    exited_at: float = 0.0
    seen_running_at: float = 0.0  # wall clock: the last poll that found its process running
    last_step: int = 0
    started_at: float = field(default_factory=time.monotonic)
    stop_grace_s: float = 5.0  # SIGTERM to SIGKILL, the generation's
    exit_report: keel_pb2.RankExited | None = field(default=None)
    token: str = field(default="", repr=False)  # its credential on the agent's socket
    attached: bool = False  # it said it reports steps (AgentLocal.Attach)
    warm: bool = False  # started from a warm process (agent.pool)
    in_place: bool = False  # it said it can restart in place (Attach)
    reused: bool = False  # a parked process of an earlier generation became it
    tearing_down: bool = False  # it said it is on its way to park (RankPark.tearing_down)
    start: keel_pb2.StartGeneration | None = field(default=None, repr=False)
    # Its group's processes that SIGKILL did not end within the reap wait, found once.
    stuck: tuple[keel_pb2.StuckProcess, ...] = ()

    @property
    def live(self) -> bool:
        """Its process runs this generation's rank (not exited, not parked)."""
        return (
            self.phase
            in (RankPhase.RUNNING, RankPhase.LEAVING, RankPhase.STOPPING, RankPhase.KILLED)
            and self.popen.returncode is None
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def move(self, target: RankPhase, why: str) -> None:
        """Enter ``target`` (one line in the log); raises IllegalRankTransition if the
        lifecycle does not allow it."""
        if target not in RANK_TRANSITIONS[self.phase]:
            raise IllegalRankTransition(
                f"rank {self.rank} (pid {self.pid}) cannot go from "
                f"{self.phase.value} to {target.value}"
            )
        log.info(
            "rank phase",
            job=self.job,
            generation=self.generation,
            rank=self.rank,
            pid=self.pid,
            **{"from": self.phase.value, "to": target.value},
            why=why,
        )
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
    def __init__(
        self,
        run_dir: Path,
        reap_timeout_s: float = REAP_WAIT_S,
        node: str = "",
        interface: str = "",
        pool: WarmPool | None = None,
        in_place: bool = True,
        rank_user: RankUser | None = None,
        memory: JobMemory | None = None,
    ):
        """``interface``: where the ranks' gloo binds (GLOO_SOCKET_IFNAME), the one of
        the node's advertised address. ``pool``: warm processes to start ranks from.
        ``in_place``: keep ranks that can restart in place for the next generation.
        ``rank_user``: start ranks as this user, their directory and files its own.
        ``memory``: the memory it holds for the jobs' snapshots (``agent.memory``)."""
        self.memory = memory
        self.rank_user = rank_user
        self.in_place = in_place
        self.parking = ParkingLot()
        # Tokens of ranks asked to leave their generation (told in their acks).
        self.leaving_tokens: set[str] = set()
        self.run_dir = run_dir
        self.node = node
        self.interface = interface
        self.pool = pool
        self.reap_timeout_s = reap_timeout_s
        self.ranks: list[RankProcess] = []
        # Each rank's credential on the agent's socket, while it runs.
        self.identities: dict[str, RankIdentity] = {}

    @property
    def _as_user(self) -> tuple[int, int] | None:
        return self.rank_user.ids if self.rank_user else None

    def leaving(self, token: str) -> bool:
        """Whether the rank holding ``token`` is asked to leave its generation (any thread)."""
        return token in self.leaving_tokens

    def identify(self, token: str) -> RankIdentity | None:
        """Who presents ``token`` on the agent's socket: a rank this agent started and
        that has not exited, or None."""
        return self.identities.get(token)

    def start(
        self, start: keel_pb2.StartGeneration, agent_socket: str, chain: Deadlines
    ) -> list[RankProcess]:
        """Start the ranks ``start`` assigns to this node, each stopped (when it comes to
        that) with the generation's stop grace from ``chain``."""
        log_dir = rank_log(self.run_dir, start.job, start.generation, 0, "out").parent
        log_dir.mkdir(parents=True, exist_ok=True)
        if self.rank_user is not None:
            os.chmod(log_dir.parent, 0o711)  # the job's: passable whatever the umask
            self.rank_user.give(log_dir, 0o700)
        base = {**os.environ, **(self.rank_user.env() if self.rank_user else {})}
        memory = self._hold_memory(start)
        started = []
        for assignment in start.ranks:
            error_file = log_dir / f"rank{assignment.rank}.error.json"
            error_file.unlink(missing_ok=True)
            token = secrets.token_urlsafe(24)
            env = rank_env(
                base,
                start,
                assignment,
                agent_socket,
                str(error_file),
                chain,
                token,
                self.node,
                self.interface,
                memory,
            )
            out = rank_log(self.run_dir, start.job, start.generation, assignment.rank, "out")
            err = out.with_suffix(".err")
            if self.rank_user is not None:
                # Warm and parked processes open them as the rank user.
                for path in (out, err):
                    path.touch(mode=0o600)
                    self.rank_user.give(path, 0o600)
            parked = self.parking.take(start, assignment) if self.in_place else None
            if parked is not None:
                parked.start(env, str(out), str(err))
                popen = parked.popen
            else:
                popen = self._warm(start, assignment, env, out, err)
            warm = popen is not None and parked is None
            if popen is None:
                with open(out, "ab") as out_file, open(err, "ab") as err_file:
                    popen = subprocess.Popen(
                        [*tied_to_this_process(self._as_user), *start.command],
                        env=env,
                        stdout=out_file,
                        stderr=err_file,
                        stdin=subprocess.DEVNULL,
                        cwd=start.working_dir or None,
                        start_new_session=True,
                    )
            proc = RankProcess(
                job=start.job,
                generation=start.generation,
                rank=assignment.rank,
                local_rank=assignment.local_rank,
                popen=popen,
                log_dir=log_dir,
                stop_grace_s=chain.stop_grace_s,
                warm=warm,
                reused=parked is not None,
                start=start,
                # It parked through trainer.runtime: it attaches again.
                attached=parked is not None,
                in_place=parked is not None,
            )
            self.ranks.append(proc)
            self.identities[token] = RankIdentity(
                job=start.job,
                generation=start.generation,
                ranks=frozenset({assignment.rank}),
                checkpoint_dir=start.checkpoint_dir,
            )
            proc.token = token
            started.append(proc)
            log.info(
                "rank started",
                job=start.job,
                generation=start.generation,
                rank=assignment.rank,
                warm=proc.warm,
                in_place=proc.reused,
                pid=popen.pid,
                **({"warm_ready": self.pool.taken_ready} if warm else {}),
            )
        # Parked processes this generation has no place for go.
        self.parking.release_all(
            f"generation {start.generation} of {start.job} starts here without them",
            time.monotonic(),
        )
        return started

    def _hold_memory(self, start: keel_pb2.StartGeneration) -> dict[str, str]:
        """The memory tier's variables for the job's ranks: {} where the node holds no
        memory for it, or cannot (the ranks then train without snapshots)."""
        if self.memory is None:
            return {}
        try:
            return self.memory.hold(start.job_id)
        except OSError as exc:
            log.warning(
                "cannot hold memory for the job's snapshots; its ranks train without",
                job=start.job,
                path=str(self.memory.root),
                error=str(exc),
            )
            return {}

    def park(
        self, token: str, request: keel_pb2.RankPark, now: float
    ) -> keel_pb2.RankExited | str | None:
        """The rank holding ``token`` left its generation alive: it is done for that
        generation (the returned report says so) and waits in the parking lot. A string
        says why it is not kept (the rank then exits as it would have); None answers a
        rank that says it is tearing down (it has the stop grace to park)."""
        proc = next(
            (
                r
                for r in self.ranks
                if r.token == token and r.phase in (RankPhase.RUNNING, RankPhase.LEAVING)
            ),
            None,
        )
        if proc is None:
            return "it is not a running rank of this agent"
        if not self.in_place:
            return "this agent keeps no ranks for restart in place (--no-restart-in-place)"
        if not proc.in_place or proc.start is None or proc.start.cold_start:
            return (
                "its job asked for fresh processes (cold_start)"
                if proc.start is not None and proc.start.cold_start
                else "it did not attach with restart_in_place"
            )
        if request.tearing_down:
            proc.tearing_down = True
            log.info(
                "rank is leaving its generation alive",
                job=proc.job,
                generation=proc.generation,
                rank=proc.rank,
                pid=proc.pid,
            )
            return None
        asked = proc.phase is RankPhase.LEAVING
        # Nothing of the generation it leaves may run on: what it started in its group goes.
        for pid in group_members(proc.pid):
            if pid != proc.pid:
                _kill(pid)
        proc.move(
            RankPhase.PARKED,
            "it left the generation alive: "
            + ("asked to" if asked else "the generation failed under it"),
        )
        proc.exited_at = now
        self.identities.pop(token, None)
        self.leaving_tokens.discard(token)
        proc.exit_report = keel_pb2.RankExited(
            job=proc.job,
            generation=proc.generation,
            rank=proc.rank,
            pid=proc.pid,
            exit_code=1 if request.failed else 0,
            traceback=request.reason[-8000:],
            stderr_tail=tail(proc.stderr_path)[-4000:],
            exited_at=time.time(),
            stopped_by_agent=asked,
            last_step=proc.last_step,
            reaped_at=time.time(),
            parked=True,
        )
        self.parking.park(
            token,
            Parked(
                popen=proc.popen,
                job=proc.job,
                generation=proc.generation,
                rank=proc.rank,
                slot=proc.local_rank,
                command=tuple(proc.start.command),
                working_dir=proc.start.working_dir,
                job_env=dict(proc.start.env),
            ),
        )
        return proc.exit_report

    def _warm(
        self,
        start: keel_pb2.StartGeneration,
        assignment: keel_pb2.RankAssignment,
        env: dict[str, str],
        out: Path,
        err: Path,
    ) -> subprocess.Popen | None:
        """A warm process become the rank, or None to start it cold."""
        if self.pool is None or start.cold_start:
            return None
        popen = self.pool.take(
            assignment.local_rank, list(start.command), dict(start.env), time.monotonic()
        )
        if popen is None:
            return None
        try:
            self.pool.hand(popen, list(start.command), env, start.working_dir, out, err)
        except OSError as exc:  # it died since it was checked
            log.warning(
                "a warm process could not take its rank; starting it cold",
                pid=popen.pid,
                error=str(exc),
            )
            signal_group(popen.pid, signal.SIGKILL)
            return None
        return popen

    def of_generation(self, job: str, generation: int) -> list[RankProcess]:
        return [r for r in self.ranks if r.job == job and r.generation == generation]

    def stop(self, ranks: list[RankProcess], now: float, leave: bool = True) -> None:
        """Begin the stop protocol for ``ranks``: a rank that can restart in place is
        asked to leave its generation alive (unless ``leave`` is False: a hung rank, an
        agent shutting down), every other running one gets SIGTERM to its group."""
        for proc in ranks:
            if proc.phase is RankPhase.RUNNING and leave and self.in_place and proc.in_place:
                proc.move(
                    RankPhase.LEAVING,
                    f"asked to leave the generation alive, SIGTERM "
                    f"in {self._park_window(proc):g} s if it has not",
                )
                proc.stop_requested_at = now
                self.leaving_tokens.add(proc.token)
            elif proc.phase in (RankPhase.RUNNING, RankPhase.LEAVING):
                self._terminate(proc, now)

    @staticmethod
    def _park_window(proc: RankProcess) -> float:
        return proc.stop_grace_s if proc.tearing_down else min(PARK_WINDOW_S, proc.stop_grace_s)

    def _terminate(self, proc: RankProcess, now: float) -> None:
        proc.move(RankPhase.STOPPING, "SIGTERM to its process group")
        proc.stop_requested_at = now
        self.leaving_tokens.discard(proc.token)
        signal_group(proc.pid, signal.SIGTERM)

    def poll(self, now: float) -> list[RankProcess]:
        """Advance every rank's lifecycle; return ranks whose process just exited."""
        exited = []
        self.parking.poll(now)
        looked_at = time.time()
        for proc in self.ranks:
            if proc.phase in (
                RankPhase.RUNNING,
                RankPhase.LEAVING,
                RankPhase.STOPPING,
                RankPhase.KILLED,
            ):
                code = proc.popen.poll()
                if code is None:
                    proc.seen_running_at = looked_at
                if code is not None:
                    stopped = proc.phase is not RankPhase.RUNNING
                    proc.move(RankPhase.EXITED, f"exit status {code}")
                    proc.exited_at = now
                    proc.exit_report = self._exit_report(proc, code, stopped)
                    self.identities.pop(proc.token, None)
                    self.leaving_tokens.discard(proc.token)
                    # Whatever the rank left in its group (workers, helpers) goes with it.
                    signal_group(proc.pid, signal.SIGKILL)
                    exited.append(proc)
                elif (
                    proc.phase is RankPhase.LEAVING
                    and now - proc.stop_requested_at >= self._park_window(proc)
                ):
                    log.info(
                        "rank did not leave its generation in time; stopping it",
                        rank=proc.rank,
                        pid=proc.pid,
                        window_s=self._park_window(proc),
                    )
                    self._terminate(proc, now)
                elif (
                    proc.phase is RankPhase.STOPPING
                    and now - proc.stop_requested_at >= proc.stop_grace_s
                ):
                    log.warning(
                        "rank ignored SIGTERM; killing its process group",
                        rank=proc.rank,
                        pid=proc.pid,
                        grace_s=proc.stop_grace_s,
                    )
                    proc.move(RankPhase.KILLED, f"SIGTERM ignored for {proc.stop_grace_s:g} s")
                    proc.killed_at = now
                    signal_group(proc.pid, signal.SIGKILL)
                elif (
                    proc.phase is RankPhase.KILLED
                    and not proc.stuck
                    and now - proc.killed_at >= self.reap_timeout_s
                ):
                    proc.stuck = stuck_processes(proc.pid, proc.rank)
                    log.error(
                        "rank did not exit after SIGKILL; its node cannot confirm the stop",
                        job=proc.job,
                        generation=proc.generation,
                        rank=proc.rank,
                        pid=proc.pid,
                        waited_s=round(now - proc.killed_at, 1),
                        processes=", ".join(
                            f"{p.pid} state {p.state} wchan {p.wchan or '?'}" for p in proc.stuck
                        ),
                    )
            if proc.phase is RankPhase.EXITED:
                if not group_alive(proc.pid):
                    proc.move(RankPhase.REAPED, "its process group is empty")
                elif now - proc.exited_at > self.reap_timeout_s:
                    log.error(
                        "process group still has members after SIGKILL",
                        rank=proc.rank,
                        pgid=proc.pid,
                    )
                    proc.move(
                        RankPhase.REAPED,
                        f"given up waiting {self.reap_timeout_s:g} s for its process group",
                    )
        return exited

    def _exit_report(self, proc: RankProcess, code: int, stopped: bool) -> keel_pb2.RankExited:
        stderr_tail = tail(proc.stderr_path)
        traceback = error_file_traceback(proc.error_file) or stderr_traceback(stderr_tail)
        # Peers of a failed rank die of its absence a moment later, often within one
        # poll, so an exit is dated by its earliest evidence: an exception by its error
        # file's mtime; an exit that left none (a SIGKILL) by the last poll that found
        # the process running. Dated by the poll that reaped it, a rank SIGKILLed just
        # before a peer's exception counted as dying after it, and the peer was named
        # the root cause.
        now = time.time()
        try:
            exited_at = min(now, proc.error_file.stat().st_mtime)
        except FileNotFoundError:
            exited_at = proc.seen_running_at or now
        return keel_pb2.RankExited(
            job=proc.job,
            generation=proc.generation,
            rank=proc.rank,
            pid=proc.pid,
            exit_code=code if code >= 0 else -1,
            signal=-code if code < 0 else 0,
            traceback=traceback,
            stderr_tail=stderr_tail[-4000:],
            exited_at=exited_at,
            stopped_by_agent=stopped,
            last_step=proc.last_step,
            reaped_at=time.time(),
        )

    def generation_done(self, job: str, generation: int) -> bool:
        """True when every rank of the generation is reaped, its group empty, or parked."""
        return all(
            r.phase in (RankPhase.REAPED, RankPhase.PARKED)
            for r in self.of_generation(job, generation)
        )

    def forget(self, job: str, generation: int) -> None:
        self.ranks = [r for r in self.ranks if not (r.job == job and r.generation == generation)]

    def stop_all(self, timeout_s: float) -> None:
        """Blocking stop of every rank (parked processes stay in the lot)."""
        self.stop(self.ranks, time.monotonic(), leave=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll(time.monotonic())
            if all(r.phase in (RankPhase.REAPED, RankPhase.PARKED) for r in self.ranks):
                return
            time.sleep(0.05)
        for proc in self.ranks:
            if proc.phase is not RankPhase.PARKED:
                signal_group(proc.pid, signal.SIGKILL)


def stuck_processes(pgid: int, rank: int) -> tuple[keel_pb2.StuckProcess, ...]:
    """The live processes of rank ``rank``'s group ``pgid`` (its leader first), each
    with its state letter and wait channel from /proc."""
    pids = [pgid] + [pid for pid in group_members(pgid) if pid != pgid]
    found = []
    for pid in pids:
        state = process_state(pid)
        if state is not None and state != "Z":
            found.append(
                keel_pb2.StuckProcess(pid=pid, rank=rank, state=state, wchan=process_wchan(pid))
            )
    return tuple(found)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
