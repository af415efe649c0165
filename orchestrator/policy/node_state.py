"""The states a node is in for placement, as operators read them (``keel nodes``) and
as the wire carries them (``NodeInfo.state``)."""

from __future__ import annotations

import enum

from common.proto_enums import ProtoEnum
from protos import keel_pb2


class NodeState(str, enum.Enum):
    READY = "ready"
    CORDONED = "cordoned"  # no new generation is placed on it
    DRAINING = "draining"  # cordoned, and the job is being moved off it
    DRAINED = "drained"  # cordoned, and no generation runs on it


WIRE_NODE_STATES = ProtoEnum(NodeState, keel_pb2.NodeState, "NODE_STATE_")
