"""Self-fencing: when a node that has lost touch with the cluster stops its own ranks.
Pure: the agent passes what it knows (monotonic seconds) and stops the ranks if this
says why."""

from __future__ import annotations


def self_fence(
    running: bool,
    unrenewed_s: float,
    lease_ttl_s: float,
    controller_up: bool,
    outage_seen_by_controller: bool,
) -> str:
    """Why the node's ranks stop now, or "" if they do not. A node whose generation
    is ``running``, that has renewed no lease for a whole TTL (``unrenewed_s``) and has
    no controller to vouch for it is, as far as the cluster knows, lost, and its
    replacement may start any moment. Not while the controller has said etcd is out of
    its reach too (``outage_seen_by_controller``: an outage everyone sees, where nothing
    can be replaced)."""
    if not running or unrenewed_s < lease_ttl_s or controller_up or outage_seen_by_controller:
        return ""
    return (
        f"self-fenced: no lease renewal for {unrenewed_s:.1f} s (TTL "
        f"{lease_ttl_s:g} s) and no controller reachable"
    )
