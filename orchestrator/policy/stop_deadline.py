"""Which nodes of a stopping generation are past the stop deadline: a pure decision.

A node confirms a stop once its ranks are reaped. A rank that SIGKILL does not end
(stuck in the kernel: uninterruptible I/O on a hung NFS or Lustre mount, a GPU driver
hang) is never reaped, so its node never confirms, and the job would wait for it
forever. Past ``stop_deadline_s`` (``common.deadlines``) after the stop began, such a
node is declared failed for the generation: counted lost and cordoned, with a reason
that names the processes its agent found stuck, if it said.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# What /proc/PID/stat's state letter means, as a reason says it.
STATES = {
    "D": "in uninterruptible sleep",
    "R": "running",
    "S": "sleeping",
    "T": "stopped",
    "t": "stopped by a tracer",
    "Z": "a zombie",
}


@dataclass(frozen=True)
class Stuck:
    """A process of a rank that SIGKILL has not ended, as its agent reported it."""

    pid: int
    rank: int
    state: str  # /proc/PID/stat's state letter
    wchan: str  # /proc/PID/wchan: the kernel function it waits in ("" unknown)

    def describe(self) -> str:
        state = STATES.get(self.state, f"in state {self.state or '?'}")
        wchan = f" (wchan {self.wchan})" if self.wchan and self.wchan != "0" else ""
        return f"pid {self.pid} (rank {self.rank}) {state}{wchan}"


@dataclass(frozen=True)
class Overdue:
    node: str
    reason: str


def passed(now: float, stop_began: float, deadline_s: float) -> bool:
    """Whether the stop that began at ``stop_began`` is ``deadline_s`` old at ``now``."""
    return now - stop_began >= deadline_s


def overdue(
    now: float,
    stop_began: float,
    deadline_s: float,
    waiting: frozenset[str],
    stuck: Mapping[str, tuple[Stuck, ...]],
) -> tuple[Overdue, ...]:
    """The nodes of ``waiting`` (those of the generation neither confirmed nor counted
    lost) that have not confirmed the stop that began at ``stop_began`` (seconds, on
    the clock of ``now``) within ``deadline_s``, sorted, each with why: the processes
    ``stuck`` names for it, else the silence. () before the deadline."""
    if not passed(now, stop_began, deadline_s):
        return ()
    found = []
    for node in sorted(waiting):
        processes = stuck.get(node, ())
        if processes:
            reason = "ranks did not exit after SIGKILL: " + ", ".join(
                p.describe() for p in processes
            )
        else:
            reason = f"did not confirm the stop within {deadline_s:g} s"
        found.append(Overdue(node, reason))
    return tuple(found)
