"""Controller messages an agent cannot act on are answered, never fatal: a real Agent
(on a real etcd, with no controller) is handed them directly."""

from __future__ import annotations

import queue
import shutil

import pytest

from agent.config import AgentConfig
from agent.daemon import Agent
from protos import keel_pb2


@pytest.fixture
def agent(etcd, tmp_path):
    served = Agent(AgentConfig(node="node-a", slots=1, etcd_endpoints=(etcd.endpoint,),
                               token="t", run_dir=tmp_path / "run"))
    yield served
    shutil.rmtree(served.socket_dir, ignore_errors=True)


def sent(agent: Agent) -> list[keel_pb2.AgentMessage]:
    messages = []
    while True:
        try:
            messages.append(agent.outbox.get_nowait())
        except queue.Empty:
            return messages


def test_a_stop_asking_for_stacks_of_a_generation_it_does_not_run_is_just_confirmed(agent):
    agent._on_controller(keel_pb2.ControllerMessage(stop_generation=keel_pb2.StopGeneration(
        job="demo", generation=3, reason="hang on node-b", collect_stacks=True)))
    assert agent.stopping_generation == ("demo", 3)
    assert sent(agent) == []  # no stacks to report: no rank of it runs here
    agent._maybe_confirm_stop()
    confirmed, = sent(agent)
    assert (confirmed.generation_stopped.job, confirmed.generation_stopped.generation) == \
        ("demo", 3)


def test_a_start_with_a_health_budget_that_makes_no_sense_fails_its_ranks_with_the_reason(
        agent):
    start = keel_pb2.StartGeneration(
        job="demo", generation=1, command=["python", "-c", "pass"],
        ranks=[keel_pb2.RankAssignment(rank=0, local_rank=0)],
        health=keel_pb2.HealthSpec(hang_floor_s=30, hang_k=3, first_step_timeout_s=10,
                                   checkpoint_timeout_s=60))
    agent._on_controller(keel_pb2.ControllerMessage(start_generation=start))
    exited, = sent(agent)
    assert (exited.rank_exited.rank, exited.rank_exited.exit_code) == (0, 127)
    assert "first_step_timeout_s=10" in exited.rank_exited.traceback
    assert agent.supervisor.ranks == []
