"""What a job's events tell of, as operators read them (``keel events``, ``keel up``'s
summary, log lines, metric labels) and as the wire carries them (``Event.kind``)."""

from __future__ import annotations

import enum

from common.proto_enums import ProtoEnum
from protos import keel_pb2


class EventKind(str, enum.Enum):
    CRASH = "crash"  # a rank exited with an error
    HANG = "hang"  # a rank alive without progress past its hang timeout
    STRAGGLER = "straggler"  # a node found slow
    NODE_LOST = "node_lost"  # its agent stream down or its etcd lease expired
    AGENT_RESTARTED = "agent_restarted"  # its agent came back without the generation's ranks
    REPLACED = "replaced"  # a newcomer took a node's ranks
    EXCLUDED = "excluded"  # the job was re-planned without a node
    CORDONED = "cordoned"  # a node takes no new generation
    ALERT = "alert"  # a person should look
    OPERATOR = "operator"  # an operator's request
    QUARANTINED = "quarantined"  # a checkpoint failed verification and was set aside
    CHECKPOINT_REFUSED = "checkpoint_refused"  # a stale generation's commit was refused
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed (no space, I/O); training went on
    SUSPECTED = "suspected"  # a node is suspected: the next placement avoids it
    FRESH_START = "fresh_start"  # recorded checkpoints, none verifiable: step 0 as the spec allows
    STOP_TIMEOUT = "stop_timeout"  # a node did not confirm a stop within the stop deadline


WIRE_EVENT_KINDS = ProtoEnum(EventKind, keel_pb2.EventKind, "EVENT_KIND_")
