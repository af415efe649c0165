"""Leadership: only the controller holding ``/keel/controller/leader`` acts.

The key is created in a transaction (``version == 0``) on the controller's own lease
(``leader_ttl_s``); its create revision is the leader's *term*, which only grows. A
standby keeps its lease alive and tries again every quarter TTL. The lease is refreshed
on a thread of its own (``start``), on a client of its own whose calls have the lease
path's short deadline (``common.deadlines``: a refresh sent to an etcd member that
stalled fails in time for a retry on another member), never by the work: a slow
reconcile tick, or a new leader loading thousands of records under the state lock,
cannot cost the lead. The leader steps down when the lease could not be refreshed for a
whole TTL or has lapsed, or at once when a write finds the key no longer its own
(``store.Deposed``: it stalled and another took over). Who leads is followed with a
watch on the key (``common.leader.LeaderWatch``), so a standby refusing calls names
the leader without reading etcd: a storm of agents reconnecting to it costs etcd
nothing. A controller that stepped down keeps its lease: if etcd comes back with the
lease alive and the key still its own, nobody led meanwhile and it leads again at
once, with the same term. A controller that wins the key but cannot take the lead (the
rebuild from etcd raises) tries again on its next campaigns; after
``liveness.LEAD_TRIES`` in a row it revokes its lease, and the key with it, and stands
back a TTL, so that a standby gets it (``keel_controller_leads_abandoned_total``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import structlog

from common import deadlines
from common.etcd import connect
from common.leader import LeaderWatch, standby_refusal
from orchestrator.controller import metrics
from orchestrator.controller.state import ControllerState
from orchestrator.policy import liveness

log = structlog.get_logger()


class Leadership:
    def __init__(self, state: ControllerState, on_lead: Callable[[float], None]):
        """``on_lead(now)`` rebuilds what a new leader must know, under the state lock;
        if it raises (an etcd error), the campaign is tried again, up to
        ``liveness.LEAD_TRIES`` times in a row before the key is let go."""
        self.state = state
        self.on_lead = on_lead
        self.lease = None
        config = state.config
        self.lease_client = connect(
            list(config.etcd_endpoints),
            deadlines.lease_call_timeout_s(config.leader_ttl_s),
            config.etcd_credentials,
        )
        self.refreshed_at = 0.0  # monotonic: the lease was last refreshed
        self.refreshes = 0  # how many times the keeper refreshed it
        self._lapsed = None  # a lease etcd said had expired
        self.failed_takeovers = 0  # the key won, the lead not taken: in a row
        self.standing_back_until = 0.0  # monotonic: no campaign before (it let go)
        self.leader = LeaderWatch(
            state.store.client, set_aside=state.store.set_aside
        )  # who leads, as etcd says

    def start(self) -> None:
        """Keep whatever lease this controller holds alive, every third of a TTL, on a
        thread of its own, until the controller stops; and follow the leader key."""
        self.leader.start()
        threading.Thread(target=self._keep_alive, name="leader-lease", daemon=True).start()

    def _keep_alive(self) -> None:
        """Refresh on the lease path's schedule (``common.deadlines``); after a failed
        refresh, again soon (a refresh that failed or took long leaves less of the TTL:
        at 4,000 simulated nodes on two cores the lease lapsed with no tick over its
        budget). A refresh that takes over a third of the TTL, or fails, is a warning
        (at most one a TTL) with how long it took."""
        state = self.state
        ttl_s = state.config.leader_ttl_s
        wait, warned_at = deadlines.lease_refresh_s(ttl_s), -ttl_s
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
                wait = deadlines.lease_retry_s(ttl_s)
                continue
            wait = deadlines.lease_refresh_s(ttl_s)
            if ttl > 0:
                self.refreshed_at, self.refreshes = now, self.refreshes + 1
            else:
                self._lapsed = lease

    def campaign(self, now: float) -> bool:
        """One try at the leader key; True if this controller now leads."""
        state = self.state
        if now < self.standing_back_until:
            return False
        alive = False
        if self.lease is not None:
            try:
                alive = self.lease.refresh()[0].TTL > 0
            except Exception:
                alive = False
        if alive:
            self.refreshed_at = time.monotonic()
        if not alive:
            self.lease = self.lease_client.lease(int(state.config.leader_ttl_s))
        term = state.store.campaign(state.id, state.address, self.lease.id)
        if term is None:
            return False
        with state.lock:
            try:
                self.on_lead(now)
            except Exception as exc:  # an etcd error, or a record it cannot load
                self._failed_takeover(now, term, exc)
                return False
            self.failed_takeovers = 0
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
            epoch=state.store.epoch,
            jobs=len(state.jobs),
        )
        return True

    def _failed_takeover(self, now: float, term: int, exc: Exception) -> None:
        """The key is won but the lead not taken: held on to, the key would keep every
        standby from leading; let it go after ``liveness.LEAD_TRIES`` tries in a row."""
        state = self.state
        state.store.term, state.jobs = None, {}
        self.failed_takeovers += 1
        reason = liveness.let_go_reason(self.failed_takeovers, f"{type(exc).__name__}: {exc}")
        if not reason:
            log.warning(
                "won the leader key but could not take the lead; trying again",
                controller_id=state.id,
                term=term,
                tries=self.failed_takeovers,
                error=str(exc),
            )
            return
        lease, self.lease, self.failed_takeovers = self.lease, None, 0
        self.standing_back_until = now + state.config.leader_ttl_s
        try:
            lease.revoke()  # the key goes with it
        except Exception as error:  # the lease then lapses within a TTL unrefreshed
            log.warning("could not revoke the controller lease", error=str(error))
        metrics.LEADS_ABANDONED.inc()
        log.error(
            "let the leader key go for a standby",
            controller_id=state.id,
            term=term,
            reason=reason,
            stand_back_s=state.config.leader_ttl_s,
        )

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
        return standby_refusal(leader.address if leader else None)

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
