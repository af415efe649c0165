"""Every kind of message on the wire has its handler: the controller one for each kind
of agent message, the agent one for each kind of controller message."""

import shutil

from agent.config import AgentConfig
from agent.daemon import Agent
from orchestrator.controller.config import ControllerConfig
from orchestrator.controller.sessions import AgentService
from orchestrator.controller.state import ControllerState
from orchestrator.controller.store import Store
from protos import keel_pb2


def kinds(message) -> set[str]:
    return {field.name for field in message.DESCRIPTOR.oneofs_by_name["kind"].fields}


def test_the_controller_records_every_kind_of_agent_message():
    state = ControllerState(
        ControllerConfig(etcd_endpoints=("127.0.0.1:2379",), token="t"), Store(client=None)
    )
    service = AgentService(state, leadership=None)
    try:
        assert set(service._handlers) == kinds(keel_pb2.AgentMessage)
    finally:
        service.admitting.shutdown()


def test_the_agent_does_every_kind_of_controller_message(tmp_path):
    agent = Agent(
        AgentConfig(
            node="node-a",
            slots=1,
            etcd_endpoints=("127.0.0.1:1",),
            token="t",
            run_dir=tmp_path,
            warm_processes=False,
        )
    )
    try:
        assert set(agent._commands) == kinds(keel_pb2.ControllerMessage)
    finally:
        shutil.rmtree(agent.socket_dir, ignore_errors=True)
