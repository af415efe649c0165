"""What a daemon cannot act on is answered or left out, never fatal: controller
messages a real Agent (on a real etcd) is handed directly, job records in etcd a real
controller cannot read, and step reports it cannot use."""

from __future__ import annotations

import json
import queue
import shutil
import threading

import grpc
import pytest

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.generation import Phase
from common.tls import call_metadata
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import wait_for
from tests.integration.test_control_plane import TOKEN, cluster  # noqa: F401  (fixture)


@pytest.fixture
def agent(etcd, tmp_path):
    served = Agent(
        AgentConfig(
            node="node-a",
            slots=1,
            etcd_endpoints=(etcd.endpoint,),
            token="t",
            run_dir=tmp_path / "run",
        )
    )
    yield served
    shutil.rmtree(served.socket_dir, ignore_errors=True)


def sent(agent: Agent) -> list[keel_pb2.AgentMessage]:
    messages = []
    while True:
        try:
            messages.append(agent.link.outbox.get_nowait())
        except queue.Empty:
            return messages


def test_a_stop_asking_for_stacks_of_a_generation_it_does_not_run_is_just_confirmed(agent):
    agent._on_controller(
        keel_pb2.ControllerMessage(
            stop_generation=keel_pb2.StopGeneration(
                job="demo", generation=3, reason="hang on node-b", collect_stacks=True
            )
        )
    )
    assert (agent.generation.phase, agent.generation.stopping) == (Phase.STOPPING, ("demo", 3))
    assert sent(agent) == []  # no stacks to report: no rank of it runs here
    agent._maybe_confirm_stop()
    (confirmed,) = sent(agent)
    assert (confirmed.generation_stopped.job, confirmed.generation_stopped.generation) == (
        "demo",
        3,
    )
    assert agent.generation.phase is Phase.IDLE


def test_a_start_whose_deadlines_make_no_sense_fails_its_ranks_with_the_reason(agent):
    start = keel_pb2.StartGeneration(
        job="demo",
        generation=1,
        command=["python", "-c", "pass"],
        ranks=[keel_pb2.RankAssignment(rank=0, local_rank=0)],
        health=keel_pb2.HealthSpec(hang_k=3),
        deadlines=keel_pb2.Deadlines(
            hang_floor_s=30,
            first_step_timeout_s=10,
            checkpoint_timeout_s=60,
            collective_timeout_s=600,
            startup_timeout_s=600,
        ),
    )
    agent._on_controller(keel_pb2.ControllerMessage(start_generation=start))
    (exited,) = sent(agent)
    assert (exited.rank_exited.rank, exited.rank_exited.exit_code) == (0, 127)
    assert "first_step_timeout_s=10" in exited.rank_exited.traceback
    assert agent.supervisor.ranks == []

    # A start without its deadline chain is no start the controller sends.
    start.generation = 2
    start.ClearField("deadlines")
    agent._on_controller(keel_pb2.ControllerMessage(start_generation=start))
    (exited,) = sent(agent)
    assert (exited.rank_exited.generation, exited.rank_exited.exit_code) == (2, 127)
    assert "carries no deadlines" in exited.rank_exited.traceback
    assert agent.supervisor.ranks == []


def test_a_job_record_it_cannot_read_is_left_out_and_the_controller_still_leads(cluster):  # noqa: F811
    client = cluster.store.client
    client.put("/keel/jobs/broken/spec", json.dumps({"name": "broken", "worldSize": "many"}))
    client.put(
        "/keel/jobs/broken/state", json.dumps({"state": "DREAMING", "generation": 1, "restarts": 0})
    )
    address = cluster.controller()  # waits until it holds the leader key
    # It loads the jobs right after taking the key.
    wait_for(
        lambda: (
            "cannot read the job's records in etcd; not managing it"
            in (cluster.path / "controller.log").read_text()
        ),
        30,
        what="the job to be left out",
    )
    with grpc.insecure_channel(address) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        jobs = stub.ListJobs(keel_pb2.ListJobsRequest(), metadata=call_metadata(TOKEN), timeout=5)
        assert [job.name for job in jobs.jobs] == []
        # The records are left as they were, for a version that can read them.
        assert json.loads(client.get("/keel/jobs/broken/state")[0])["state"] == "DREAMING"

        # Step reports numbered from 0, or with a step time that is no number of
        # seconds, are dropped with a warning; the agent's stream stays open.
        lease = client.lease(30)
        done = threading.Event()

        def messages():
            yield keel_pb2.AgentMessage(
                hello=keel_pb2.Hello(
                    node="node-z", host="127.0.0.1", slots=1, lease_id=lease.id, pid=1
                )
            )
            yield keel_pb2.AgentMessage(
                steps=keel_pb2.StepReportBatch(
                    job="broken",
                    generation=1,
                    node_steps=[
                        keel_pb2.NodeStep(step=0, ranks=[0], step_time_s=[0.1]),
                        keel_pb2.NodeStep(step=3, ranks=[1], step_time_s=[float("inf")]),
                    ],
                )
            )
            done.wait(30)

        stream = stub.Connect(messages(), metadata=call_metadata(TOKEN))
        try:
            wait_for(
                lambda: (
                    "ignoring step reports numbered below 1"
                    in (cluster.path / "controller.log").read_text()
                ),
                30,
                what="the reports to be dropped",
            )
            assert "agent message failed" not in (cluster.path / "controller.log").read_text()
            nodes = stub.ListNodes(
                keel_pb2.ListNodesRequest(), metadata=call_metadata(TOKEN), timeout=5
            ).nodes
            assert [(n.node, n.connected) for n in nodes] == [("node-z", True)]
            # A reason is stored with the cordon: a sentence, not a megabyte.
            with pytest.raises(grpc.RpcError) as err:
                stub.CordonNode(
                    keel_pb2.NodeRequest(node="node-z", reason="x" * 2000),
                    metadata=call_metadata(TOKEN),
                    timeout=5,
                )
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "2000 characters; keep it under 1024" in err.value.details()
            assert cluster.store.cordons() == {}
        finally:
            done.set()
            stream.cancel()
        lease.revoke()
