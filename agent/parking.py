"""Restart in place: rank processes that left their generation alive (``Park``) and wait
to become a rank of the next one.

A rank that uses ``trainer.runtime`` with restart in place, when its generation ends
under it (a collective failed because a peer died, or the agent asked it to leave),
tears down its process group and everything built on it, then parks: from then on it
counts as exited for that generation, and it asks the agent for the next one
(``NextGeneration``, a long poll). When that generation places the same rank on the
same slot of this node, for the same job, command, working directory and job
environment (``Parked.fits`` says why the same rank), the
parked process is given that rank's environment and output files and becomes it
(``Parked.start``); otherwise it is told to exit (``Parked.release``). A parked process
that is not adopted within ``PARK_TTL_S``, one whose node drains, and every one when
the agent stops, are released too; one that does not exit within ``RELEASE_GRACE_S``
of being told is SIGKILLed with its process group.

Only the answer crosses threads: the main thread decides, the local server's thread
hands the answer to the waiting rank.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import time
from dataclasses import dataclass, field

import structlog

from common.procs import process_state, signal_group
from protos import keel_pb2

log = structlog.get_logger()

# Long enough for the controller's back-off (at most 30 s) and a re-plan; a parked
# process holds its slot's memory (and on a GPU its context) while it waits.
PARK_TTL_S = 300.0
RELEASE_GRACE_S = 5.0
# How long one NextGeneration call is held open when there is nothing to say yet.
POLL_HOLD_S = 1.0


@dataclass(eq=False)
class Parked:
    """A process that left ``generation`` of ``job``, parked on ``slot``."""

    popen: subprocess.Popen
    job: str
    generation: int
    rank: int
    slot: int
    command: tuple[str, ...]
    working_dir: str
    job_env: dict[str, str]
    since: float = field(default_factory=time.monotonic)
    released_at: float | None = None
    adopted: bool = False  # given a rank; forgotten once it has its answer
    answers: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def fits(self, start: keel_pb2.StartGeneration, assignment: keel_pb2.RankAssignment) -> bool:
        """Whether it can become ``assignment`` of ``start``: the same job, command,
        working directory and job environment, the same rank on its own slot (its
        device), alive and not stopped, not yet released, and the job did not ask for
        fresh processes.

        The same rank: torch's DTensor keeps what it derived from a device mesh (its
        sharding specs, each shard's offsets) for the life of the process, looked up by
        mesh *equality*, which does not look at the process's rank. A process that
        became another rank of an equal mesh (rank 1 of dp_shard=2, then rank 0 of it)
        was handed its old shards' offsets: every checkpoint plan then covered half of
        each tensor. A different world size or layout makes unequal meshes."""
        return (
            self.released_at is None
            and not self.adopted
            and not start.cold_start
            and start.job == self.job
            and assignment.local_rank == self.slot
            and assignment.rank == self.rank
            and tuple(start.command) == self.command
            and start.working_dir == self.working_dir
            and dict(start.env) == self.job_env
            and self.popen.poll() is None
            and process_state(self.pid) not in ("T", "t", None)
        )

    def start(self, env: dict[str, str], stdout: str, stderr: str) -> None:
        """Hand it its new rank."""
        self.adopted = True
        self.answers.put(
            keel_pb2.NextGenerationAnswer(
                action=keel_pb2.NEXT_GENERATION_ACTION_START, env=env, stdout=stdout, stderr=stderr
            )
        )

    def release(self, reason: str, now: float) -> None:
        """Tell it to exit; it is SIGKILLed if it has not ``RELEASE_GRACE_S`` later."""
        if self.released_at is not None or self.adopted:
            return
        log.info(
            "releasing a parked rank process",
            job=self.job,
            generation=self.generation,
            rank=self.rank,
            slot=self.slot,
            pid=self.pid,
            reason=reason,
        )
        self.released_at = now
        self.answers.put(
            keel_pb2.NextGenerationAnswer(
                action=keel_pb2.NEXT_GENERATION_ACTION_EXIT, reason=reason
            )
        )

    def answer(self, hold_s: float = POLL_HOLD_S) -> keel_pb2.NextGenerationAnswer:
        """What to tell it now: its answer if there is one (within ``hold_s``), else wait.
        An exit is said again to every later call."""
        try:
            answer = self.answers.get(timeout=hold_s)
        except queue.Empty:
            return keel_pb2.NextGenerationAnswer(action=keel_pb2.NEXT_GENERATION_ACTION_WAIT)
        if answer.action == keel_pb2.NEXT_GENERATION_ACTION_EXIT:
            self.answers.put(answer)
        return answer


class ParkingLot:
    """The parked processes of this agent, by the token each parked with."""

    def __init__(self, ttl_s: float = PARK_TTL_S):
        self.ttl_s = ttl_s
        self.by_token: dict[str, Parked] = {}

    def park(self, token: str, parked: Parked) -> None:
        log.info(
            "rank parked",
            job=parked.job,
            generation=parked.generation,
            rank=parked.rank,
            slot=parked.slot,
            pid=parked.pid,
        )
        self.by_token[token] = parked

    def find(self, token: str) -> Parked | None:
        """The parked process holding ``token`` (any thread)."""
        return self.by_token.get(token)

    def answer(self, token: str) -> keel_pb2.NextGenerationAnswer | None:
        """The answer for the parked process holding ``token`` (the local server's
        thread; held up to ``POLL_HOLD_S``), or None if no parked process holds it.
        Once it has its new rank, its token here is forgotten."""
        parked = self.by_token.get(token)
        if parked is None:
            return None
        answer = parked.answer()
        if answer.action == keel_pb2.NEXT_GENERATION_ACTION_START:
            self.by_token.pop(token, None)
        return answer

    def take(
        self, start: keel_pb2.StartGeneration, assignment: keel_pb2.RankAssignment
    ) -> Parked | None:
        """The parked process that can become ``assignment`` (then ``Parked.start`` it)."""
        return next((p for p in list(self.by_token.values()) if p.fits(start, assignment)), None)

    def pids(self) -> set[int]:
        return {p.pid for p in list(self.by_token.values())}

    def release_all(self, reason: str, now: float) -> None:
        """Every parked process not given a rank is told to exit."""
        for parked in list(self.by_token.values()):
            parked.release(reason, now)

    def poll(self, now: float) -> None:
        """Forget the ones that exited, release the ones parked too long, and kill the
        released ones that did not exit in time."""
        for token, parked in list(self.by_token.items()):
            code = parked.popen.poll()
            if code is not None:
                log.info(
                    "parked rank process exited",
                    job=parked.job,
                    rank=parked.rank,
                    pid=parked.pid,
                    exit_code=code,
                    released=parked.released_at is not None,
                )
                signal_group(parked.pid, signal.SIGKILL)  # whatever it left in its group
                del self.by_token[token]
            elif parked.adopted:
                continue
            elif parked.released_at is None and now - parked.since >= self.ttl_s:
                parked.release(f"no generation took it in {self.ttl_s:g} s", now)
            elif parked.released_at is not None and now - parked.released_at >= RELEASE_GRACE_S:
                log.warning(
                    "a released parked process did not exit; killing its group",
                    pid=parked.pid,
                    grace_s=RELEASE_GRACE_S,
                )
                signal_group(parked.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        """Agent shutdown: every parked process goes, now."""
        for parked in list(self.by_token.values()):
            signal_group(parked.pid, signal.SIGKILL)
        for parked in list(self.by_token.values()):
            try:
                parked.popen.wait(5)
            except subprocess.TimeoutExpired:
                log.error("a parked process survived SIGKILL", pid=parked.pid)
        self.by_token.clear()
