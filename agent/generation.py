"""Which generation this agent runs, and where it is in its life here: a lifecycle with
its allowed transitions in one table, each transition one log line.

    IDLE ──start──► RUNNING ──stop (controller, or a hang found here)──► STOPPING
      ▲               │ start (a newer one: the older one is stopped first) │
      └──── every rank of it reaped, confirmed to the controller ◄──────────┘

A stop may come for a generation that does not run here (the controller ends it
everywhere, or stops a stale one); it is confirmed as soon as nothing of it is left,
and the generation that does run here, if any, goes on RUNNING.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import structlog

from common.proto_enums import ProtoEnum
from protos import keel_pb2

log = structlog.get_logger()


class Phase(str, enum.Enum):
    IDLE = "IDLE"  # no generation is being run or stopped here
    RUNNING = "RUNNING"  # ``start`` was given; its ranks run (or some have exited)
    STOPPING = "STOPPING"  # ``stopping`` is being stopped; confirmed once all is reaped


# The phases on the wire (AgentStatus.phase).
WIRE_PHASES = ProtoEnum(Phase, keel_pb2.AgentPhase, "AGENT_PHASE_")

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.RUNNING: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.STOPPING: frozenset({Phase.RUNNING, Phase.STOPPING, Phase.IDLE}),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Generation:
    """``start``: the StartGeneration this agent runs (kept while it is stopped, so a
    Hello still names it); ``stopping``: (job, generation) being stopped, to confirm;
    ``hang_reported``: this agent already reported a hang of ``start`` (one per
    generation)."""

    phase: Phase = Phase.IDLE
    start: keel_pb2.StartGeneration | None = None
    stopping: tuple[str, int] | None = None
    hang_reported: bool = False

    def _move(self, target: Phase, why: str, job: str, generation: int) -> None:
        if target not in TRANSITIONS[self.phase]:
            raise IllegalTransition(
                f"generation {generation} of {job}: cannot go from "
                f"{self.phase.value} to {target.value}"
            )
        log.info(
            "generation phase",
            job=job,
            generation=generation,
            **{"from": self.phase.value, "to": target.value},
            why=why,
        )
        self.phase = target

    def begin(self, start: keel_pb2.StartGeneration) -> None:
        self._move(Phase.RUNNING, "started by the controller", start.job, start.generation)
        self.start, self.hang_reported = start, False

    def stop(self, job: str, generation: int, why: str) -> None:
        self._move(Phase.STOPPING, why, job, generation)
        self.stopping = (job, generation)

    def stopped(self) -> tuple[str, int]:
        """Every rank of the generation being stopped is reaped; it is forgotten
        (``start`` too, if it was that one: else ``start`` goes on RUNNING). Returns
        (job, generation)."""
        job, generation = self.stopping
        if self.running(job, generation):
            self.start = None
        self._move(
            Phase.RUNNING if self.start is not None else Phase.IDLE,
            "every rank of the stopped one reaped",
            job,
            generation,
        )
        self.stopping = None
        return job, generation

    def running(self, job: str, generation: int) -> bool:
        """Whether ``job``'s ``generation`` is the one this agent runs."""
        return self.start is not None and (self.start.job, self.start.generation) == (
            job,
            generation,
        )
