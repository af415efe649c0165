"""A running generation's memory-snapshot partner, kept by the controller: a lost one
is replaced by another that holds memory (and its node's agent told), and a
controller that adopts the generation learns it from the agent's Hello, telling
again an agent that missed the change."""

from common.records import NodeRecord
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.executor import Executor
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.state import AgentSession, ControllerState
from orchestrator.controller.store import Store
from orchestrator.policy.adoption import Account, AccountDecision
from orchestrator.policy.lifecycle import JobState
from orchestrator.policy.placement import NodeRanks
from protos import keel_pb2

GRACE = 10.0


def cluster(*nodes: str) -> ControllerState:
    """A controller leading since 0 (past the takeover grace from then on), with
    ``nodes`` registered and connected, each holding memory."""
    state = ControllerState(
        ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t", node_lost_grace_s=GRACE),
        Store(client=None),
    )
    state.is_leader, state.leader_since = True, -1000.0
    for pid, node in enumerate(nodes, 1):
        state.registered[node] = NodeRecord(host="h", slots=2, pid=pid, lease_id=pid)
        state.attach(session(node, pid))
    return state


def session(node: str, pid: int, replica_node: str = "") -> AgentSession:
    hello = keel_pb2.Hello(
        node=node, peer_address=f"{node}:7000", lease_ttl_s=5.0, replica_node=replica_node
    )
    return AgentSession(node=node, host="h", slots=2, lease_id=pid, pid=pid, hello=hello, term=1)


def running(partners: dict[str, str]) -> JobRuntime:
    job = JobRuntime(
        spec=keel_pb2.JobSpec(name="j", world_size=2),
        state=JobState.RUNNING,
        state_rev=1,
        state_since_mono=0.0,
        generation=3,
        placement=[NodeRanks("a", (0, 1))],
    )
    job.replica_partners = dict(partners)
    return job


def told(state: ControllerState, node: str) -> list[keel_pb2.ReplicaPartner]:
    outbox, sent = state.sessions[node].outbox, []
    while not outbox.empty():
        message = outbox.get_nowait()
        if message is not None and message.HasField("replica_partner"):
            sent.append(message.replica_partner)
    return sent


def lose(state: ControllerState, node: str, at: float) -> None:
    state.detach(state.sessions[node], at)
    del state.registered[node]


def test_a_lost_partner_is_replaced_and_the_nodes_agent_told_where_to():
    state = cluster("a", "b", "c")
    executor, job = Executor(state), running({"a": "b"})
    executor.repartner(job, 1.0)
    assert job.replica_partners == {"a": "b"} and told(state, "a") == []  # b serves
    lose(state, "b", 1.0)
    executor.repartner(job, 1.5)
    assert job.replica_partners == {"a": "c"}
    (message,) = told(state, "a")
    assert (message.job, message.generation, message.node, message.address) == (
        "j",
        3,
        "c",
        "c:7000",
    )
    executor.repartner(job, 2.0)  # c serves: nothing more
    assert told(state, "a") == []


def test_with_no_other_node_holding_memory_the_controller_looks_again_a_grace_later():
    state = cluster("a", "b")
    executor, job = Executor(state), running({"a": "b"})
    lose(state, "b", 1.0)
    executor.repartner(job, 1.5)
    assert job.replica_partners == {"a": "b"} and job.repartner_after == 1.5 + GRACE
    state.registered["c"] = NodeRecord(host="h", slots=2, pid=3, lease_id=3)
    state.attach(session("c", 3))
    executor.repartner(job, 1.5 + GRACE - 0.1)
    assert told(state, "a") == []
    executor.repartner(job, 1.5 + GRACE)
    assert job.replica_partners == {"a": "c"} and [m.node for m in told(state, "a")] == ["c"]


def adopt(executor: Executor, state: ControllerState, job: JobRuntime, hello_partner: str):
    state.attach(session("a", 1, replica_node=hello_partner))
    decision = AccountDecision(Account.ADOPT, "j", "the job's running generation", 3, (0, 1))
    state.jobs["j"] = job
    executor.account(state.sessions["a"], [decision])


def test_an_adopted_generation_keeps_the_partner_its_agent_names_or_is_told_again():
    # A controller that took over knows no partner: it learns the agent's, and
    # replaces it when it is lost.
    state = cluster("a", "b", "c")
    executor, job = Executor(state), running({})
    adopt(executor, state, job, "b")
    assert job.replica_partners == {"a": "b"} and told(state, "a") == []
    lose(state, "b", 1.0)
    executor.repartner(job, 1.5)
    assert job.replica_partners == {"a": "c"}
    # An agent whose stream went down as it was told of c comes back naming b.
    adopt(executor, state, job, "b")
    assert [m.node for m in told(state, "a")] == ["c"]
    assert job.replica_partners == {"a": "c"}
