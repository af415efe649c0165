"""Which rank, if any, has hung: a pure decision over the ranks' latest progress.

A rank makes progress when it reports a finished step. It has hung when it made none
for longer than the timeout of the phase it is in: before its first step (start-up:
rendezvous, model build, preflight), while saving a checkpoint, or between steps.
Only a rank that reports steps can be judged on them: one that neither said it would
(``reports_steps``, a rank using ``trainer.runtime``) nor reported one (a plain
torchrun script) is never hung, whatever its first step takes; its exits and its
liveness are what it is judged on.
No I/O, no clock reads: the caller passes ``now`` in the seconds of the clock its
``RankProgress`` times come from.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from common.wire_kinds import HangPhase

PHASES = tuple(HangPhase)


@dataclass(frozen=True)
class HangConfig:
    # A step timeout proportional to the step time catches a stalled rank within
    # seconds on sub-second steps; the floor keeps short, jittery steps (and a
    # report-flush period) from tripping it.
    floor_s: float = 30.0  # the step timeout is never shorter
    k: float = 10.0  # step timeout = k x the median recent step time
    # Start-up and checkpoint saves are legitimately slow; they get budgets of their
    # own instead of inflating the step timeout.
    first_step_timeout_s: float = 300.0  # from process start to the first step report
    checkpoint_timeout_s: float = 300.0  # after a step whose report announced a save

    def __post_init__(self):
        for name in ("floor_s", "k", "first_step_timeout_s", "checkpoint_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{name}={getattr(self, name)}: must be positive "
                    f"(defaults: floor_s=30, k=10, first_step_timeout_s=300, "
                    f"checkpoint_timeout_s=300)"
                )
        if self.floor_s > self.first_step_timeout_s:
            raise ValueError(
                f"first_step_timeout_s={self.first_step_timeout_s} must be at "
                f"least floor_s={self.floor_s}: start-up takes longer than a "
                f"step; raise first_step_timeout_s or lower floor_s"
            )


@dataclass(frozen=True)
class RankProgress:
    """What the agent knows of one rank; times are seconds on the caller's clock."""

    rank: int
    pid: int
    started_at: float  # when the rank process started
    last_report_at: float | None  # when its latest step report arrived; None = no step yet
    last_step: int  # the step of that report; 0 = none
    checkpointing: bool  # that report said a checkpoint save follows the step
    reports_steps: bool = True  # it said it reports steps (see the module docstring)


@dataclass(frozen=True)
class Hang:
    """Rank ``rank`` made no progress for ``stalled_for_s`` seconds after step
    ``last_step``, beyond the ``timeout_s`` of its ``phase`` (one of ``PHASES``)."""

    rank: int
    pid: int
    last_step: int
    stalled_for_s: float
    timeout_s: float
    phase: HangPhase
    reason: str


def phase_of(rank: RankProgress) -> HangPhase:
    if rank.last_report_at is None:
        return HangPhase.FIRST_STEP
    return HangPhase.CHECKPOINT if rank.checkpointing else HangPhase.STEP


def hang_timeout_s(config: HangConfig, recent_step_times_s: Sequence[float], phase: str) -> float:
    """Seconds without progress after which a rank in ``phase`` has hung.
    ``recent_step_times_s``: the latest step times (seconds) of the generation."""
    return _timeout(config, recent_step_times_s, phase)[0]


def find_hang(
    now: float,
    ranks: Sequence[RankProgress],
    recent_step_times_s: Sequence[float],
    config: HangConfig,
) -> Hang | None:
    """The rank whose progress is oldest among those stalled beyond their phase's
    timeout (ties: the lowest rank), or None. The oldest is named because when one rank
    stops, its peers stop soon after, blocked in a collective waiting for it."""
    stalled = []
    for rank in ranks:
        phase = phase_of(rank)
        if phase == "first_step" and not rank.reports_steps:
            continue  # a plain script: no step will ever say it progresses
        since = rank.started_at if rank.last_report_at is None else rank.last_report_at
        timeout_s, why = _timeout(config, recent_step_times_s, phase)
        if now - since > timeout_s:
            stalled.append((since, rank.rank, rank, phase, timeout_s, why))
    if not stalled:
        return None
    since, _, rank, phase, timeout_s, why = min(stalled, key=lambda s: (s[0], s[1]))
    stalled_for_s = now - since
    after = (
        "since it started, before its first step"
        if phase == "first_step"
        else f"after step {rank.last_step}"
        + (", saving a checkpoint" if phase == "checkpoint" else "")
    )
    reason = (
        f"rank {rank.rank} (pid {rank.pid}) made no progress for {stalled_for_s:.1f} s "
        f"{after} ({why})"
    )
    return Hang(rank.rank, rank.pid, rank.last_step, stalled_for_s, timeout_s, phase, reason)


def _timeout(
    config: HangConfig, recent_step_times_s: Sequence[float], phase: str
) -> tuple[float, str]:
    """The timeout (seconds) of ``phase`` and how it was reached, for the reason."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: use one of {', '.join(PHASES)}")
    if phase == "first_step":
        return config.first_step_timeout_s, (
            f"first-step timeout {config.first_step_timeout_s:.1f} s"
        )
    if not recent_step_times_s:
        step_s = config.floor_s
        step_why = f"timeout {step_s:.1f} s, the floor (no step times yet)"
    else:
        median_s = statistics.median(recent_step_times_s)
        scaled_s = config.k * median_s
        step_s = max(config.floor_s, scaled_s)
        step_why = (
            f"timeout {step_s:.1f} s = {config.k:g} x median step {median_s:.3g} s "
            f"(floor {config.floor_s:.1f} s)"
            if scaled_s > config.floor_s
            else f"timeout {step_s:.1f} s, the floor ({config.k:g} x median step "
            f"{median_s:.3g} s = {scaled_s:.3g} s)"
        )
    if phase == "step":
        return step_s, step_why
    if config.checkpoint_timeout_s >= step_s:
        return config.checkpoint_timeout_s, (
            f"checkpoint timeout {config.checkpoint_timeout_s:.1f} s"
        )
    return step_s, f"{step_why}, above the checkpoint timeout {config.checkpoint_timeout_s:.1f} s"
