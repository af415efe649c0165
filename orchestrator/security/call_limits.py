"""How large a request each controller method takes, and how many calls it serves at
once (enforced as ``common.call_bounds`` says: the largest entry by gRPC before it
buffers a message, the others on the bytes before they are parsed)."""

from __future__ import annotations

from common.call_bounds import KIB, MIB, RequestLimits
from orchestrator.security.auth import SERVICE

CONTROLLER_LIMITS = RequestLimits(
    per_method={
        # An agent's stream, per message: the largest is a hang's stacks, up to 64 KiB
        # of each rank's stderr tail for every rank of a node (up to 1,024 slots).
        SERVICE + "Connect": 64 * MIB,
        # A job spec is stored in etcd as one value, under its 1.5 MiB request limit
        # (orchestrator/controller/store): a larger one could not be kept.
        SERVICE + "SubmitJob": 1 * MIB,
    },
    # Every other call names a job or a node, with at most a reason of 1,024 characters.
    default_bytes=64 * KIB,
)
