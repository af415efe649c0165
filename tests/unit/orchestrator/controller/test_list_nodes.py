"""``ListNodes`` is built again only when what it shows changed: every way the node
tables change (a session attached or detached, a node record put, deleted or read
whole, a cordon set or lifted, a job placed, started or ended) shows in the next
reply, and a reply with nothing changed is the one already built."""

from types import SimpleNamespace

from etcd3 import events

from common.records import CordonRecord, NodeRecord
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.operator_service import OperatorService
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.controller.store import Store
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.node_state import WIRE_NODE_STATES
from orchestrator.policy.placement import NodeRanks
from protos import keel_pb2


class Leading:
    """A leadership that always leads (the refusal path is the daemon's, tested there)."""

    def require(self, context) -> None:
        pass


def service() -> tuple[ControllerState, OperatorService]:
    state = ControllerState(
        ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t"), Store(client=None)
    )
    state.is_leader = True
    return state, OperatorService(state, Leading(), executor=None)


def shown(operator: OperatorService) -> dict[str, tuple]:
    reply = operator.ListNodes(keel_pb2.ListNodesRequest(), context=None)
    return {
        n.node: (n.connected, WIRE_NODE_STATES.text(n.state), n.job, n.slots, n.cordon_reason)
        for n in reply.nodes
    }


def session(node: str) -> AgentSession:
    return AgentSession(
        node=node, host="h", slots=8, lease_id=7, pid=1, hello=keel_pb2.Hello(), term=1
    )


def node(slots: int) -> NodeRecord:
    return NodeRecord(host="h", slots=slots, pid=1, lease_id=7)


def put(name: str, slots: int) -> events.PutEvent:
    kv = SimpleNamespace(key=f"/keel/nodes/{name}".encode(), value=node(slots).to_json().encode())
    return events.PutEvent(SimpleNamespace(kv=kv))


def test_every_change_to_the_node_tables_shows_in_the_next_reply():
    state, operator = service()
    assert shown(operator) == {}
    state.registered["a"] = node(8)
    assert shown(operator) == {"a": (False, "ready", "", 8, "")}
    a = session("a")
    state.attach(a)
    assert shown(operator)["a"][0] is True
    state.detach(a)
    assert shown(operator)["a"][0] is False
    state.nodes_changed([put("b", 4)])
    assert shown(operator)["b"] == (False, "ready", "", 4, "")
    state.nodes_changed(
        [events.DeleteEvent(SimpleNamespace(kv=SimpleNamespace(key=b"/keel/nodes/b", value=b"")))]
    )
    assert "b" not in shown(operator)
    state.nodes_read([SimpleNamespace(key=b"/keel/nodes/c", value=node(2).to_json())], 0)
    # b's record is gone, a's too (a is still shown: its session, though down, is known)
    assert shown(operator) == {"a": (False, "ready", "", 8, ""), "c": (False, "ready", "", 2, "")}
    state.cordons["c"] = CordonRecord(drain=True, reason="disk", by="reconciler", at_unix=0.0)
    assert shown(operator)["c"] == (False, "drained", "", 2, "disk (by the reconciler)")
    spec = keel_pb2.JobSpec(name="j", world_size=2, steps=10)
    job = JobRuntime.new(spec, JobState.RUNNING, 1, 0.0)
    state.jobs["j"] = job
    job.placement = [NodeRanks("c", (0, 1))]
    assert shown(operator)["c"][1:3] == ("draining", "j")
    job.state = JobState.SUCCEEDED  # ended: holds no node
    assert shown(operator)["c"][1:3] == ("drained", "")
    state.cordons.pop("c")
    assert shown(operator)["c"][1] == "ready"
    state.attach(session("c"))
    state.drop_sessions()  # stepping down
    assert shown(operator)["c"][0] is False


def test_a_reply_with_nothing_changed_is_not_built_again():
    state, operator = service()
    for name in ("a", "b"):
        state.registered[name] = node(8)
        state.attach(session(name))
    first = operator.ListNodes(keel_pb2.ListNodesRequest(), context=None)
    assert operator.ListNodes(keel_pb2.ListNodesRequest(), context=None) is first
    state.registered["b"] = node(4)
    assert operator.ListNodes(keel_pb2.ListNodesRequest(), context=None) is not first
