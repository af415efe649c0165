"""A controller that took over counts no node lost while the cluster is still coming
back to it, and stops waiting once agents stop arriving, or after TAKEOVER_GRACES."""

from types import SimpleNamespace
from unittest import mock

from etcd3 import events

from common.records import NodeRecord
from orchestrator.controller import observe
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.controller.store import Store
from orchestrator.policy.liveness import TAKEOVER_GRACES
from protos import keel_pb2

GRACE = 10.0


def taken_over_at(t: float) -> ControllerState:
    state = ControllerState(
        ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t", node_lost_grace_s=GRACE),
        Store(client=None),
    )
    state.is_leader, state.leader_since = True, t
    state.registered["n1"] = NodeRecord(host="h", slots=8, pid=1, lease_id=1)
    return state


def test_an_agent_not_back_is_given_the_grace_then_counted_lost_when_none_arrive():
    state = taken_over_at(1000.0)
    assert observe.node_usable(state, "n1", 1000.0 + GRACE - 0.1)
    assert not observe.node_usable(state, "n1", 1000.0 + GRACE)


def test_while_agents_keep_arriving_the_wait_goes_on_up_to_its_cap():
    state = taken_over_at(1000.0)
    for t in (1005.0, 1012.0, 1019.0, 1026.0):  # a storm: one agent in every 7 s
        state.agent_knocked_at = t
        assert observe.node_usable(state, "n1", t + GRACE / 2 - 0.1)
    assert not observe.node_usable(state, "n1", 1026.0 + GRACE / 2)  # none for half a grace
    state.agent_knocked_at = 1000.0 + TAKEOVER_GRACES * GRACE - 1
    assert observe.node_usable(state, "n1", 1000.0 + TAKEOVER_GRACES * GRACE - 0.5)
    assert not observe.node_usable(state, "n1", 1000.0 + TAKEOVER_GRACES * GRACE)


def test_a_node_without_a_record_gets_the_first_grace_of_a_takeover_only():
    """etcd revoked every lease at once (the leader's too, hence the takeover): each
    agent registers again on a new lease at its next refresh. A node truly gone is
    counted lost one grace into the lead, however long the reconnect storm lasts."""
    state = taken_over_at(1000.0)
    assert observe.node_usable(state, "n2", 1000.0 + GRACE - 0.1)
    state.agent_knocked_at = 1000.0 + GRACE - 1  # agents still arriving
    assert not observe.node_usable(state, "n2", 1000.0 + GRACE)
    assert observe.node_usable(state, "n1", 1000.0 + GRACE)  # registered: still waited for


def test_a_node_connected_here_without_a_record_is_usable_for_the_first_grace_only():
    """An agent that learned of the new leader before its next refresh found its lease
    revoked connects unregistered; one grace into the lead, a node connected here with
    no record is lost at once (a stalled agent's lease lapsed)."""
    state = taken_over_at(1000.0)
    state.sessions["n2"] = AgentSession(
        node="n2", host="h", slots=8, lease_id=2, pid=2, hello=keel_pb2.Hello(), term=1
    )
    assert observe.node_usable(state, "n2", 1000.5)
    assert observe.node_usable(state, "n2", 1000.0 + GRACE - 0.1)
    assert not observe.node_usable(state, "n2", 1000.0 + GRACE)


def test_a_late_delete_from_the_revoke_does_not_count_a_reconnected_node_lost():
    """A sequence that fits what a CI run saw: etcd revoked every lease; the agent
    registered again and its Hello put the record, then the watch brought the revoke's
    delete of the old record (the put of the new one follows a moment later). In
    between, the node is connected here with no record: counted lost at once, a healthy
    job failed. One grace into the lead it no longer has that benefit."""
    state = taken_over_at(1000.0)
    state.attach(
        AgentSession(
            node="n1", host="h", slots=8, lease_id=9, pid=1, hello=keel_pb2.Hello(), term=1
        )
    )
    gone = SimpleNamespace(kv=SimpleNamespace(key=b"/keel/nodes/n1", value=b""))
    state.nodes_changed([events.DeleteEvent(gone)])
    assert "n1" not in state.registered
    assert observe.node_usable(state, "n1", 1001.0)
    assert not observe.node_usable(state, "n1", 1000.0 + GRACE)


def test_a_revoked_record_of_a_connected_agent_waits_a_lease_ttl_a_dead_agents_does_not():
    """etcd revoked the leases one by one, the nodes' before the leader's (CI saw the
    leader count both nodes of a running job lost, stop it and fail it, in the
    milliseconds before its own key went): long into a lead, the record of an agent
    whose stream is up gets the agent's lease TTL to come back. A dead agent's stream
    went down before its lease lapsed: its record's going loses it at once."""
    state = taken_over_at(0.0)
    for node, pid in (("n1", 1), ("n2", 2)):
        state.registered[node] = NodeRecord(host="h", slots=8, pid=pid, lease_id=pid)
        state.attach(
            AgentSession(
                node=node,
                host="h",
                slots=8,
                lease_id=pid,
                pid=pid,
                hello=keel_pb2.Hello(lease_ttl_s=5.0),
                term=1,
            )
        )
    state.sessions["n2"].connected, state.sessions["n2"].disconnected_at = False, 999.0

    def gone(node):
        kv = SimpleNamespace(key=f"/keel/nodes/{node}".encode(), value=b"")
        return events.DeleteEvent(SimpleNamespace(kv=kv))

    with mock.patch("orchestrator.controller.state.time.monotonic", return_value=1000.0):
        state.nodes_changed([gone("n1"), gone("n2")])
    assert observe.node_usable(state, "n1", 1004.9)
    assert not observe.node_usable(state, "n1", 1005.0)
    assert not observe.node_usable(state, "n2", 1000.0)
    assert observe.newly_lost(
        state, SimpleNamespace(nodes={"n1", "n2"}, lost_nodes=set()), 1001.0
    ) == ["n2"]
    # Registered again: the next time its record goes, its TTL counts from then.
    state.nodes_changed([])
    record = NodeRecord(host="h", slots=8, pid=1, lease_id=7)
    put = events.PutEvent(
        SimpleNamespace(kv=SimpleNamespace(key=b"/keel/nodes/n1", value=record.to_json().encode()))
    )
    state.nodes_changed([put])
    assert "n1" in state.registered and "n1" not in state.unregistered_at
