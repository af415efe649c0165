"""Leadership: only the controller holding ``/keel/controller/leader`` acts.

The key is created in a transaction (``version == 0``) on the controller's own lease
(``leader_ttl_s``); its create revision is the leader's *term*, which only grows. A
standby keeps its lease alive and tries again every quarter TTL. The lease is refreshed
every third of a TTL on a thread of its own (``start``), never by the work: a slow
reconcile tick, or a new leader loading thousands of records under the state lock,
cannot cost the lead. The leader steps down when the lease could not be refreshed for a
whole TTL or has lapsed, or at once when a write finds the key no longer its own
(``store.Deposed``: it stalled and another took over). Who leads is followed with a
watch on the key (``common.leader.LeaderWatch``), so a standby refusing calls names
the leader without reading etcd: a storm of agents reconnecting to it costs etcd
nothing. A controller that stepped down keeps its lease: if etcd comes back with the
lease alive and the key still its own, nobody led meanwhile and it leads again at
once, with the same term.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import structlog

from common.leader import LeaderWatch
from orchestrator.controller import metrics
from orchestrator.controller.state import ControllerState
from orchestrator.policy import liveness

log = structlog.get_logger()


class Leadership:
    def __init__(self, state: ControllerState, on_lead: Callable[[float], None]):
        """``on_lead(now)`` rebuilds what a new leader must know, under the state lock;
        it may raise on an etcd error (the campaign is then tried again)."""
        self.state = state
        self.on_lead = on_lead
        self.lease = None
        self.refreshed_at = 0.0  # monotonic: the lease was last refreshed
        self.refreshes = 0  # how many times the keeper refreshed it
        self._lapsed = None  # a lease etcd said had expired
        self.leader = LeaderWatch(
            state.store.client, set_aside=state.store.set_aside
        )  # who leads, as etcd says

    def start(self) -> None:
        """Keep whatever lease this controller holds alive, every third of a TTL, on a
        thread of its own, until the controller stops; and follow the leader key."""
        self.leader.start()
        threading.Thread(target=self._keep_alive, name="leader-lease", daemon=True).start()

    def _keep_alive(self) -> None:
        """Refresh every third of a TTL; after a failed refresh, again every twelfth (a
        refresh that failed or took long leaves less of the TTL: at 4,000 simulated
        nodes on two cores the lease lapsed with no tick over its budget). A refresh
        that takes over a third of the TTL, or fails, is a warning (at most one a TTL)
        with how long it took."""
        state = self.state
        ttl_s = state.config.leader_ttl_s
        wait, warned_at = ttl_s / 3, -ttl_s
        while not state.stopping.wait(wait):
            lease = self.lease
            if lease is None:
                continue
            began = time.monotonic()
            try:
                ttl = lease.refresh()[0].TTL
                problem = None
            except Exception as exc:  # ``keep`` decides once a whole TTL passed
                ttl, problem = None, f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            took = now - began
            if (problem or took > ttl_s / 3) and now - warned_at >= ttl_s:
                warned_at = now
                log.warning(
                    "leader lease refresh slow or failed",
                    took_s=round(took, 3),
                    since_refreshed_s=round(now - self.refreshed_at, 3),
                    error=problem,
                )
            if ttl is None:
                wait = ttl_s / 12
                continue
            wait = ttl_s / 3
            if ttl > 0:
                self.refreshed_at, self.refreshes = now, self.refreshes + 1
            else:
                self._lapsed = lease

    def campaign(self, now: float) -> bool:
        """One try at the leader key; True if this controller now leads."""
        state = self.state
        alive = False
        if self.lease is not None:
            try:
                alive = self.lease.refresh()[0].TTL > 0
            except Exception:
                alive = False
        if alive:
            self.refreshed_at = time.monotonic()
        if not alive:
            self.lease = state.store.client.lease(int(state.config.leader_ttl_s))
        term = state.store.campaign(state.id, state.address, self.lease.id)
        if term is None:
            return False
        with state.lock:
            self.on_lead(now)
            state.leader_since, self.refreshed_at = now, max(self.refreshed_at, now)
            state.is_leader = True
        metrics.LEADER.set(1)
        metrics.TERM.set(term)
        metrics.LEADER_CHANGES.inc()
        log.info(
            "leading",
            controller_id=state.id,
            address=state.address,
            term=term,
            jobs=len(state.jobs),
        )
        return True

    def keep(self, now: float) -> bool:
        """Whether the leader lease is alive, as the keeper thread last found it (no
        etcd call here); steps down if it lapsed or could not be refreshed for a whole
        TTL. True while leading."""
        reason = liveness.step_down_reason(
            self._lapsed is not None and self._lapsed is self.lease,
            now - self.refreshed_at,
            self.state.config.leader_ttl_s,
        )
        if not reason:
            return True
        self.step_down(reason)
        return False

    def step_down(self, reason: str) -> None:
        state = self.state
        with state.lock:
            if not state.is_leader and state.store.term is None:
                return  # down already (every caller that finds the lead gone says so)
            was = state.store.term
            state.is_leader = False
            state.store.term = None
            state.drop_sessions()
            state.jobs.clear()
        # The lease is kept: see the module docstring.
        metrics.LEADER.set(0)
        metrics.TERM.set(0)
        metrics.LEADER_CHANGES.inc()
        metrics.prune(set())
        log.warning("stepped down", controller_id=state.id, term=was, reason=reason)

    def refusal(self) -> str | None:
        """Why a call must be refused UNAVAILABLE (this controller does not lead; the
        message names the leader), or None."""
        if self.state.is_leader:
            return None
        leader = self.leader.current  # from the watch: no etcd read per refusal
        return f"standby controller; the leader is at {leader.address if leader else 'unknown'}"

    def require(self, context) -> None:
        """Abort the call with UNAVAILABLE, naming the leader, unless this controller
        leads."""
        refusal = self.refusal()
        if refusal is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, refusal)

    def release(self) -> None:
        """Give the lead up for good (shutdown): revoke the lease, and the key with it,
        once a reconcile tick under way has made its writes. A tick holds the state lock
        throughout; cut off half-way, it could have put a placement in etcd but not the
        event saying which node it replaced, and the next leader would never know. A
        tick stuck past its budget (a third of the TTL) is not waited for longer."""
        self.leader.stop()
        if self.lease is None:
            return
        state = self.state
        held = state.lock.acquire(timeout=state.config.leader_ttl_s / 3)
        try:
            try:
                self.lease.revoke()
            except Exception as exc:  # etcd may already be gone at shutdown
                log.warning("could not revoke controller lease", error=str(exc))
            if state.is_leader:
                self.step_down("shutting down: the lead is handed over")
        finally:
            if held:
                state.lock.release()
