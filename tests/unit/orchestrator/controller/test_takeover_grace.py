"""A controller that took over counts no node lost while the cluster is still coming
back to it, and stops waiting once agents stop arriving, or after TAKEOVER_GRACES."""

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


def test_a_node_that_lost_its_record_while_connected_here_is_not_usable():
    state = taken_over_at(1000.0)
    state.sessions["n2"] = AgentSession(
        node="n2", host="h", slots=8, lease_id=2, pid=2, hello=keel_pb2.Hello(), term=1
    )
    assert not observe.node_usable(state, "n2", 1000.5)
