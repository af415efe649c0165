"""Self-fencing: when a node that has lost touch with the cluster stops its own ranks,
and how long a controller's word that the outage is everyone's holds that off. Pure:
the agent passes what it knows (monotonic seconds) and stops the ranks if this says
why."""

from __future__ import annotations

import math


def self_fence(
    running: bool,
    unrenewed_s: float,
    lease_ttl_s: float,
    controller_up: bool,
    hold_left_s: float,
) -> str:
    """Why the node's ranks stop now, or "" if they do not. A node whose generation
    is ``running``, that has renewed no lease for a whole TTL (``unrenewed_s``) and has
    no controller to vouch for it is, as far as the cluster knows, lost, and its
    replacement may start any moment. Not while a hold is left (``hold_left_s`` > 0:
    the leading controller said etcd is out of its reach too, an outage everyone sees,
    where nothing can be replaced)."""
    if not running or unrenewed_s < lease_ttl_s or controller_up or hold_left_s > 0:
        return ""
    held = " and the controller's hold on it ran out" if hold_left_s > -math.inf else ""
    return (
        f"self-fenced: no lease renewal for {unrenewed_s:.1f} s (TTL "
        f"{lease_ttl_s:g} s) and no controller reachable{held}"
    )


def hold_until(now: float, hold_s: float, lease_ttl_s: float) -> float:
    """When a hold received at ``now`` for ``hold_s`` runs out. A sender that names no
    usable length (an older controller sends 0) holds for one lease TTL: long enough to
    ride out an etcd restart, never for good."""
    if not (math.isfinite(hold_s) and hold_s > 0):
        hold_s = lease_ttl_s
    return now + hold_s
