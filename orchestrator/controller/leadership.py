"""Leadership: only the controller holding ``/keel/controller/leader`` acts.

The key is created in a transaction (``version == 0``) on the controller's own lease
(``leader_ttl_s``); its create revision is the leader's *term*, which only grows. A
standby keeps its lease alive and tries again every quarter TTL; a leader refreshes it
every third of a TTL and steps down when it cannot for a whole TTL, or at once when a
write finds the key no longer its own (``store.Deposed``: it stalled and another took
over). A controller that stepped down keeps its lease: if etcd comes back with the
lease alive and the key still its own, nobody led meanwhile and it leads again at
once, with the same term.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog

from orchestrator.controller import metrics
from orchestrator.controller.state import ControllerState

log = structlog.get_logger()


class Leadership:
    def __init__(self, state: ControllerState, on_lead: Callable[[float], None]):
        """``on_lead(now)`` rebuilds what a new leader must know, under the state lock;
        it may raise on an etcd error (the campaign is then tried again)."""
        self.state = state
        self.on_lead = on_lead
        self.lease = None
        self.refreshed_at = 0.0

    def campaign(self, now: float) -> bool:
        """One try at the leader key; True if this controller now leads."""
        state = self.state
        alive = False
        if self.lease is not None:
            try:
                alive = self.lease.refresh()[0].TTL > 0
            except Exception:
                alive = False
        if not alive:
            self.lease = state.store.client.lease(int(state.config.leader_ttl_s))
        term = state.store.campaign(state.id, state.address, self.lease.id)
        if term is None:
            return False
        with state.lock:
            self.on_lead(now)
            state.leader_since, self.refreshed_at = now, now
            state.is_leader = True
        metrics.LEADER.set(1)
        metrics.TERM.set(term)
        metrics.LEADER_CHANGES.inc()
        log.info("leading", controller_id=state.id, address=state.address, term=term,
                 jobs=len(state.jobs))
        return True

    def keep(self, now: float) -> bool:
        """Refresh the leader lease; step down if it lapsed. True while leading."""
        try:
            response = self.lease.refresh()[0]
            if response.TTL > 0:
                self.refreshed_at = now
                return True
            reason = "leader lease expired"
        except Exception as exc:
            if now - self.refreshed_at < self.state.config.leader_ttl_s:
                return True  # etcd hiccup: the lease may still be alive
            reason = f"cannot refresh the leader lease: {exc}"
        self.step_down(reason)
        return False

    def step_down(self, reason: str) -> None:
        state = self.state
        with state.lock:
            was = state.store.term
            state.is_leader = False
            state.store.term = None
            for session in state.sessions.values():
                session.connected = False
                session.close()
            state.sessions.clear()
            state.jobs.clear()
        # The lease is kept: see the module docstring.
        metrics.LEADER.set(0)
        metrics.TERM.set(0)
        metrics.LEADER_CHANGES.inc()
        metrics.prune(set())
        log.warning("stepped down", controller_id=state.id, term=was, reason=reason)

    def require(self, context) -> None:
        """Abort the call with UNAVAILABLE, naming the leader, unless this controller
        leads."""
        if self.state.is_leader:
            return
        leader = None
        try:
            leader = self.state.store.controller_address()
        except Exception:
            pass
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"standby controller; the leader is at {leader or 'unknown'}")

    def release(self) -> None:
        """Give the lead up for good (shutdown): revoke the lease, and the key with it."""
        if self.lease is None:
            return
        try:
            self.lease.revoke()
        except Exception as exc:  # etcd may already be gone at shutdown
            log.warning("could not revoke controller lease", error=str(exc))
        if self.state.is_leader:
            self.step_down("shutting down: the lead is handed over")
