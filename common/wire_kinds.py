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
    UNREACHABLE = "unreachable"  # it could not be read on the reporting node: the node's problem
    SAVE_FAILED = "save_failed"  # a save failed (no space, I/O); training goes on
    FENCE_TIMEOUT = "fence_timeout"  # the fence lock was held past its deadline
    FOREIGN_LINEAGE = "foreign_lineage"  # the directory holds another lineage's checkpoints


class HangPhase(str, enum.Enum):
    """What a hung rank was doing: the budget its hang timeout was judged by (agent to
    controller)."""

    FIRST_STEP = "first_step"  # starting up, before its first step
    CHECKPOINT = "checkpoint"  # a step that saves a checkpoint
    STEP = "step"


class Collective(str, enum.Enum):
    """A collective the preflight sweep times (trainer to agent to controller, and in
    ``keel status`` and ``keel up``'s summary)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


class FaultKind(str, enum.Enum):
    """What a scripted fault does, as ``keel up --inject KIND:...`` spells it (keel up to
    the ranks, in ``KEEL_FAULTS``)."""

    # Rank faults: the trainer applies them.
    CRASH = "crash"
    KILL = "kill"
    HANG = "hang"
    SLOW = "slow"
    # Cluster faults: keel up fires them.
    LOSE_NODE = "lose_node"
    KILL_LEADER = "kill_leader"
    RESTART_ETCD = "restart_etcd"
    KILL_AGENT = "kill_agent"
    TERM_AGENT = "term_agent"
    TERM_LEADER = "term_leader"
    STALL_LEADER = "stall_leader"
    STALL_AGENT = "stall_agent"
    STALL_NODE = "stall_node"
    PARTITION_NODE = "partition_node"


WIRE_PROBLEM_KINDS = ProtoEnum(
    CheckpointProblemKind, keel_pb2.CheckpointProblemKind, "CHECKPOINT_PROBLEM_KIND_"
)
WIRE_HANG_PHASES = ProtoEnum(HangPhase, keel_pb2.HangPhase, "HANG_PHASE_")
WIRE_FAULT_KINDS = ProtoEnum(FaultKind, keel_pb2.FaultKind, "FAULT_KIND_")
WIRE_COLLECTIVES = ProtoEnum(Collective, keel_pb2.Collective, "COLLECTIVE_")
