"""Scripted, deterministic fault injection (``keel up --inject``): the schedule in
``KEEL_FAULTS``, the faults this rank applies itself, and their one-shot markers.

Steps are numbered from 1: a fault at step N fires when step N starts. A crash may
name a node (``keel up``'s numbering) instead of a rank: every rank on that node
crashes, in every generation that runs there, as on a node that fails whatever runs
on it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from google.protobuf import json_format

from common.keys import local_node
from common.wire_kinds import WIRE_FAULT_KINDS, FaultKind
from protos import keel_pb2

RANK_FAULT_KINDS = (FaultKind.CRASH, FaultKind.KILL, FaultKind.HANG, FaultKind.SLOW)
# A restarted generation replays the steps after its checkpoint; these must not fire
# again there, or a crash at step 7 would crash every generation forever (but for a
# crash of a node's ranks, which is meant to).
ONE_SHOT_FAULT_KINDS = (FaultKind.CRASH, FaultKind.KILL, FaultKind.HANG)


def parse_fault_schedule(text: str | None) -> keel_pb2.FaultSchedule:
    """Parses ``KEEL_FAULTS`` (a ``FaultSchedule`` as protobuf JSON) and checks the rank
    faults in it. Unset or empty means no faults."""
    schedule = keel_pb2.FaultSchedule()
    if not text:
        return schedule
    json_format.Parse(text, schedule)
    for index, fault in enumerate(schedule.faults):
        if fault.kind == keel_pb2.FAULT_KIND_SLOW and fault.factor < 1.0:
            raise ValueError(
                f"KEEL_FAULTS fault #{index} is slow with factor {fault.factor}; "
                f"give a step-time multiplier of at least 1, e.g. factor 3"
            )
    return schedule


def rank_faults(
    schedule: keel_pb2.FaultSchedule, rank: int, node: str = ""
) -> list[tuple[int, keel_pb2.Fault]]:
    """The faults this rank (on ``node``, "" if not known) applies itself, as ``(index
    in schedule, fault)``: kinds in ``RANK_FAULT_KINDS`` whose ``rank`` is set and
    equals ``rank``, and crashes whose ``node`` is set and names ``node`` (as ``keel
    up`` names its nodes, ``common.keys.local_node``). Other kinds (such as
    ``lose_node``) belong to the orchestrator and are left alone."""
    return [
        (index, fault)
        for index, fault in enumerate(schedule.faults)
        if WIRE_FAULT_KINDS.text(fault.kind) in RANK_FAULT_KINDS
        and (
            (fault.HasField("rank") and fault.rank == rank)
            or (
                fault.kind == keel_pb2.FAULT_KIND_CRASH
                and not fault.HasField("rank")
                and fault.HasField("node")
                and bool(node)
                and local_node(fault.node) == node
            )
        )
    ]


def fault_marker_path(checkpoint_dir: str, index: int) -> str:
    """Where the one-shot marker of schedule entry ``index`` lives."""
    return os.path.join(checkpoint_dir, ".faults", str(index))


def claim_fault(checkpoint_dir: str | None, index: int, note: str) -> bool:
    """Claims the right to fire one-shot fault ``index``: True exactly once per
    checkpoint directory, across processes and generations (the marker is created with
    O_EXCL). Without a checkpoint directory there is nothing to remember it in, so the
    fault always fires. ``note`` is written into the marker for whoever reads it later."""
    if not checkpoint_dir:
        return True
    path = fault_marker_path(checkpoint_dir, index)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as marker:
        marker.write(note + "\n")
    return True


class FaultInjector:
    """The faults of ``schedule`` that rank ``rank`` (on ``node``) applies.
    ``slow_factor`` is the step-time multiplier of a ``slow`` fault in force (1.0 if
    none)."""

    def __init__(
        self,
        schedule: keel_pb2.FaultSchedule,
        rank: int,
        generation: int,
        log: Callable[[str], None],
        node: str = "",
    ) -> None:
        self.rank = rank
        self.generation = generation
        self.slow_factor = 1.0
        self._faults = rank_faults(schedule, rank, node)
        self._log = log

    def inject(self, step: int, checkpoint_dir: str | None) -> None:
        """Applies this rank's scheduled faults for step ``step``; call it when the step
        starts. One-shot faults are remembered in ``checkpoint_dir`` (see
        ``claim_fault``). ``crash`` raises RuntimeError, ``kill`` SIGKILLs this process, ``hang``
        sleeps forever, ``slow`` sets ``slow_factor`` for this and every later step
        (``after_step`` applies it). ``ONE_SHOT_FAULT_KINDS`` (crash, kill and hang)
        fire once per checkpoint directory, whatever the generation; a crash of a
        node's ranks fires in every generation."""
        for index, fault in self._faults:
            if fault.step != step:
                continue
            kind = WIRE_FAULT_KINDS.from_wire(fault.kind)  # rank_faults kept known kinds only
            if kind in ONE_SHOT_FAULT_KINDS and fault.HasField("rank"):
                note = (
                    f"{kind.value} step={step} rank={self.rank} "
                    f"generation={self.generation} pid={os.getpid()}"
                )
                if not claim_fault(checkpoint_dir, index, note):
                    continue
            if kind is FaultKind.SLOW:
                self.slow_factor = fault.factor
                self._log(f"injected slow-down x{fault.factor:g} from step {step} (fault #{index})")
                continue
            self._log(f"injecting {kind.value} at step {step} (fault #{index})")
            if kind is FaultKind.CRASH:
                raise RuntimeError(f"injected crash at step {step} on rank {self.rank}")
            if kind is FaultKind.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: alive, silent, until the agent kills us
                time.sleep(3600)

    def after_step(self, compute_s: float) -> float:
        """Sleeps to stretch a step that computed for ``compute_s`` seconds by
        ``slow_factor``; returns the seconds slept (0 unless a ``slow`` fault is active)."""
        delay_s = (self.slow_factor - 1.0) * compute_s
        if delay_s > 0:
            time.sleep(delay_s)
        return max(delay_s, 0.0)
