"""The closed sets of values that more than one kind of process uses, as Python enums
of the strings operators read (log lines, metric labels, events), each mirroring its
``keel.proto`` enum (``common.proto_enums``)."""

from __future__ import annotations

import enum

from common.proto_enums import ProtoEnum
from protos import keel_pb2


class CheckpointProblemKind(str, enum.Enum):
    """Why a trainer would not or could not use a checkpoint (trainer to agent to
    controller)."""

    STALE_COMMIT = "stale_commit"  # its commit was refused: a newer generation owns the directory
    QUARANTINED = "quarantined"  # it failed verification and was renamed aside


class HangPhase(str, enum.Enum):
    """What a hung rank was doing: the budget its hang timeout was judged by (agent to
    controller)."""

    FIRST_STEP = "first_step"  # starting up, before its first step
    CHECKPOINT = "checkpoint"  # a step that saves a checkpoint
    STEP = "step"


WIRE_PROBLEM_KINDS = ProtoEnum(
    CheckpointProblemKind, keel_pb2.CheckpointProblemKind, "CHECKPOINT_PROBLEM_KIND_"
)
WIRE_HANG_PHASES = ProtoEnum(HangPhase, keel_pb2.HangPhase, "HANG_PHASE_")
