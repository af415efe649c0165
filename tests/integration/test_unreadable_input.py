"""What a daemon cannot act on is answered or left out, never fatal: controller
messages a real Agent (on a real etcd) is handed directly, job records in etcd a real
controller cannot read, and step reports it cannot use."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import threading
import urllib.request

import grpc
import pytest

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.generation import Phase
from common import keys
from common.records import CordonRecord, GoodputRecord, JobSpecRecord, JobState, JobStateRecord
from common.tls import call_metadata
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import wait_for
from tests.integration.conftest import TOKEN


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


def test_a_job_record_it_cannot_read_is_left_out_and_the_controller_still_leads(cluster):
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

        # Step reports for the job it left out (numbered from 0, or with a step time
        # that is no number of seconds, too) are refused before the state lock, with a
        # warning; the agent's stream stays open. (Invalid reports of a job it manages
        # are dropped and counted: tests/unit/orchestrator/controller/test_step_tallies.)
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
                    "job 'broken', which does not exist"
                    in (cluster.path / "controller.log").read_text()
                ),
                30,
                what="the reports to be refused",
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


def test_a_standby_takes_the_lead_past_stored_values_that_do_not_parse(cluster):
    """A non-JSON cordon, a job state with a field of the wrong type and a node record
    that is no record: the leader and, after it stalls, its standby both lead past them.
    Each is named in the log with its fault and counted; the unreadable cordon still
    keeps its node off; etcd keeps every value as it was."""
    client = cluster.store.client
    spec = JobSpecRecord(spec=keel_pb2.JobSpec(name="bad-state", world_size=1, command=["true"]))
    state = json.loads(
        JobStateRecord(
            state=JobState.PENDING,
            generation=0,
            restarts=0,
            reason="submitted",
            failures=[],
            initial_loss=None,
            stop_requested="",
            stop_now=False,
            planned_stop=False,
            ended_at_unix=None,
            goodput=GoodputRecord(
                start_unix=0.0,
                cursor_unix=0.0,
                seconds={},
                phase="waiting",
                ran=False,
                ended=False,
                at_risk=[],
                generation=0,
                world_size=0,
                last_step=0,
            ),
            restarts_by_cause={},
            checkpoint_problems={},
            state_seconds={},
            state_entered_at_unix=0.0,
            tokens=0,
            step=0,
        ).to_json()
    )
    bad = {
        keys.cordon("not-a-node"): "not json {",
        keys.job_state("bad-state"): json.dumps(state | {"generation": "two"}),
        keys.node("ghost"): '{"host": 7}',
    }
    good_cordon = CordonRecord(reason="bad fan", by="operator", drain=False, at_unix=1.0)
    client.put(keys.cordon("node-ok"), good_cordon.to_json())
    client.put(keys.job_spec("bad-state"), spec.to_json())
    for key, value in bad.items():
        client.put(key, value)

    def metrics_of(name):
        launcher = ("-m", "orchestrator.cli", "controller", "--metrics-listen", "127.0.0.1:0")
        launcher += ("--metrics-address-file", str(cluster.path / f"{name}.metrics"))
        return launcher

    cluster.controller(launcher=metrics_of("first"), name="first")
    standby = cluster.controller(launcher=metrics_of("standby"), name="standby", lead=False)
    # The leader stalls (a gray failure, not a clean stop): the standby takes over once
    # its lease lapses, and the old leader, woken, leads nothing.
    first = cluster.controllers[0]
    os.kill(first.pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: cluster.store.controller_address() == standby, 60, what="the standby to lead"
        )
    finally:
        os.kill(first.pid, signal.SIGCONT)
    wait_for(
        lambda: "stepped down" in (cluster.path / "first.log").read_text(),
        30,
        what="the woken leader to step down",
    )
    assert cluster.store.controller_address() == standby

    def named(name):
        """The bad keys that ``name``'s log names as set aside."""
        lines = (cluster.path / f"{name}.log").read_text().splitlines()
        return [key for key in bad if any(key in ln and "does not parse" in ln for ln in lines)]

    for name in ("first", "standby"):
        wait_for(lambda n=name: named(n) == list(bad), 30, what=f"{name} to name each bad value")
    log = (cluster.path / "standby.log").read_text()
    assert "Expected `int`, got `str` - at `$.generation`" in log
    assert "cannot read the job's records in etcd; not managing it" in log
    with grpc.insecure_channel(standby) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        meta = call_metadata(TOKEN)
        assert stub.ListJobs(keel_pb2.ListJobsRequest(), metadata=meta, timeout=5).jobs == []
        nodes = {
            n.node: n
            for n in stub.ListNodes(keel_pb2.ListNodesRequest(), metadata=meta, timeout=5).nodes
        }
    assert set(nodes) == {"not-a-node", "node-ok"}  # the ghost's record is passed over
    assert (
        nodes["node-ok"].state == keel_pb2.NODE_STATE_CORDONED
        and nodes["node-ok"].cordon_reason == "bad fan"
    )
    assert nodes["not-a-node"].state == keel_pb2.NODE_STATE_CORDONED
    assert "its cordon record does not parse" in nodes["not-a-node"].cordon_reason
    assert "keel uncordon not-a-node" in nodes["not-a-node"].cordon_reason
    scraped = (
        urllib.request.urlopen(
            f"http://{(cluster.path / 'standby.metrics').read_text().strip()}/metrics", timeout=5
        )
        .read()
        .decode()
    )
    counted = {
        record: float(value)
        for record, value in re.findall(
            r'^keel_records_set_aside_total\{record="(\w+)"\} (\S+)$', scraped, re.M
        )
    }
    assert counted["cordon"] >= 1 and counted["job_state"] >= 1 and counted["node"] >= 1, counted
    assert counted["plan"] == counted["checkpoint"] == 0
    for key, value in bad.items():
        assert client.get(key)[0].decode() == value
