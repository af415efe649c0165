"""Leadership does not share a thread with the work (orchestrator/controller/leadership):
a reconcile tick held up past the leader lease's TTL does not cost the lead, a
standby refuses agents without reading etcd, and a leader handing over lets the tick
under way finish its writes."""

from __future__ import annotations

import math
import sys
import threading
import time

import grpc
import pytest

from common import deadlines
from common.etcd import connect
from common.records import EventRecord
from common.tls import call_metadata
from orchestrator.controller import metrics
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.daemon import Controller
from orchestrator.controller.leadership import Leadership
from orchestrator.controller.store import Store
from orchestrator.policy import liveness
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import wait_for


def test_a_tick_held_up_past_the_lease_ttl_keeps_the_lead(etcd):
    controller = Controller(
        ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t", leader_ttl_s=2.0)
    )
    address = controller.serve()
    state, leadership = controller.state, controller.leadership
    try:
        wait_for(lambda: state.is_leader, 30, what="the controller to lead")
        term = state.store.term
        # The deterministic hold-up: the state lock, which every tick takes, held here
        # (as a slow tick or a leader loading thousands of records would hold it) until
        # the lease has been refreshed more times since than fit in its 2 s TTL (the
        # first may come at once: the count is one more than a TTL's worth).
        needed = math.ceil(2.0 / deadlines.lease_refresh_s(2.0)) + 2
        with state.lock:
            held, refreshes = time.monotonic(), leadership.refreshes
            wait_for(
                lambda: leadership.refreshes >= refreshes + needed,
                30,
                what="the lease to be refreshed while the work is stuck",
            )
            assert time.monotonic() - held > 2.0
            assert state.store.controller_address() == address  # the key never lapsed
        # The held-up tick runs, and the loop after it: still the leader, in the same term.
        wait_for(
            lambda: leadership.refreshes >= refreshes + needed + 2, 30, what="two more refreshes"
        )
        assert leadership.keep(time.monotonic())
        assert state.is_leader and state.store.term == term
        assert state.store.controller_address() == address
    finally:
        controller.shutdown()


def test_a_leader_handing_over_lets_the_tick_under_way_write_what_it_decided(etcd):
    """SIGTERM to a leader (``shutdown``) hands the lead over once the tick under way has
    made its writes: a tick that put a placement in etcd also saves the event saying
    which node it replaced, and the next leader shows it (were the lease let go at once,
    that event would be lost: keel up's drain-and-handover test, under load)."""
    controller = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t"))
    controller.serve()
    state, leadership = controller.state, controller.leadership
    wait_for(lambda: state.is_leader, 30, what="the controller to lead")
    reader = Store(connect([etcd.endpoint], 5))
    event = EventRecord(
        event=keel_pb2.Event(
            kind=keel_pb2.EVENT_KIND_REPLACED, reason="node-1 replaced by node-2", seq=1
        )
    )
    revoked, written_before_revoke = threading.Event(), []
    revoke = leadership.lease.revoke

    def revoke_and_note():
        written_before_revoke.append(reader.events("held") == [event])
        result = revoke()
        revoked.set()
        return result

    leadership.lease.revoke = revoke_and_note
    stopper = threading.Thread(target=controller.shutdown)
    with state.lock:  # a tick under way
        # The deterministic hook: the lock, saying when the handover waits for it.
        state.lock = WaitedFor(state.lock, Leadership.release)
        stopper.start()
        wait_for(
            lambda: revoked.is_set() or state.lock.waited.is_set(),
            30,
            what="the handover to revoke the lease, or to wait for the tick",
        )
        state.store.put_events("held", [(1, event)])  # the tick's last write
    stopper.join(60)
    try:
        assert not stopper.is_alive()
        assert written_before_revoke == [True]
        assert reader.events("held") == [event]
        assert reader.controller_address() is None  # and the lead was handed over
    finally:
        reader.client.close()


class WaitedFor:
    """A lock that notes when the function ``where`` asks for it."""

    def __init__(self, lock, where):
        self.lock, self.where, self.waited = lock, where.__code__, threading.Event()

    def acquire(self, *args, **kwargs):
        if sys._getframe(1).f_code is self.where:
            self.waited.set()
        return self.lock.acquire(*args, **kwargs)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def test_a_storm_of_connects_refused_by_a_standby_reads_nothing_from_etcd(etcd):
    """A standby names the leader from its watch of the leader key: agents reconnecting
    to it all at once (after a failover, say) cost etcd no read."""
    leader = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t"))
    leader_address = leader.serve()
    wait_for(lambda: leader.state.is_leader, 30, what="the first controller to lead")
    standby = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t"))
    standby_address = standby.serve()
    try:
        wait_for(
            lambda: standby.leadership.leader.current is not None,
            30,
            what="the standby to see the leader",
        )
        client, reads = standby.state.store.client, []

        def counting(real, name):
            def counted(*args, **kwargs):
                reads.append(name)
                return real(*args, **kwargs)

            return counted

        for name in ("get", "get_response", "get_range_response", "get_prefix", "get_all"):
            setattr(client, name, counting(getattr(client, name), name))
        hello = keel_pb2.AgentMessage(hello=keel_pb2.Hello(node="node-x", slots=1, lease_id=1))
        with grpc.insecure_channel(standby_address) as channel:
            stub = keel_pb2_grpc.ControllerStub(channel)
            for _ in range(50):
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Connect(iter([hello]), metadata=call_metadata("t"), timeout=5))
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
                assert leader_address in err.value.details()
        assert not standby.state.is_leader
        assert reads == [], f"refused connects read etcd: {sorted(set(reads))}"
    finally:
        standby.shutdown()
        leader.shutdown()


def test_a_controller_that_cannot_take_the_lead_lets_the_key_go_to_a_standby(etcd):
    """A controller that wins the leader key but whose takeover raises every time (the
    fault injected: its rebuild from etcd fails, as a compacted revision between pages
    or a job it cannot load would make it) lets the key go after
    ``liveness.LEAD_TRIES`` tries, and the standby leads. Before, it kept the key alive
    without leading, and no controller ever led."""
    stuck = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t"))
    tries = []

    def takeover_that_fails(now):
        tries.append(now)
        raise RuntimeError("the rebuild failed")

    stuck.leadership.on_lead = takeover_that_fails
    abandoned = metrics.LEADS_ABANDONED._value.get()
    stuck_address = stuck.serve()
    reader = Store(connect([etcd.endpoint], 5))
    standby = None
    try:
        wait_for(
            lambda: reader.controller_address() == stuck_address,
            30,
            what="the failing controller to win the key",
        )
        standby = Controller(ControllerConfig(etcd_endpoints=(etcd.endpoint,), token="t"))
        standby_address = standby.serve()
        wait_for(lambda: standby.state.is_leader, 60, what="the standby to lead")
        assert reader.controller_address() == standby_address
        assert len(tries) >= liveness.LEAD_TRIES
        assert metrics.LEADS_ABANDONED._value.get() == abandoned + 1
        assert not stuck.state.is_leader and stuck.state.jobs == {}
        # The standby leads for good: the one that let go does not take the key back.
        wait_for(
            lambda: standby.leadership.refreshes >= 8, 30, what="the standby to keep its lease"
        )
        assert standby.state.is_leader and reader.controller_address() == standby_address
    finally:
        stuck.shutdown()
        if standby is not None:
            standby.shutdown()
        reader.client.close()
