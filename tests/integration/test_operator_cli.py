"""The read-only operator commands against a real controller and agents."""

from __future__ import annotations

import json
import sys

import grpc

from common.tls import call_metadata
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import keel, wait_for
from tests.integration.conftest import TOKEN


def test_status_nodes_jobs_and_events(cluster, etcd):
    address = cluster.controller()
    cluster.agent("node-a")
    cluster.agent("node-b")
    wait_for(lambda: len(cluster.store.nodes()) == 2, 30, what="two nodes registered")
    with grpc.insecure_channel(address) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        spec = keel_pb2.JobSpec(
            name="exits-3",
            world_size=1,
            max_restarts=0,
            command=[sys.executable, "-c", "import sys; sys.exit(3)"],
        )
        stub.SubmitJob(
            keel_pb2.SubmitJobRequest(spec=spec), metadata=call_metadata(TOKEN), timeout=10
        )
        wait_for(
            lambda: (
                stub.GetJob(
                    keel_pb2.GetJobRequest(job="exits-3"), metadata=call_metadata(TOKEN), timeout=5
                ).state
                == keel_pb2.JOB_STATE_FAILED
            ),
            60,
            what="the job to fail",
        )
    token = str(cluster.path / "token")
    # Found through etcd, like an operator who knows only the etcd endpoints.
    common = ["--etcd-endpoints", etcd.endpoint, "--token-file", token]

    status = keel("status", *common, timeout_s=60)
    assert status.returncode == 0, status.stderr
    assert f"controller {address}: 2/2 nodes connected, 4 slots, 1 job(s)" in status.stdout
    assert "exits-3" in status.stdout and "FAILED" in status.stdout

    nodes = json.loads(keel("nodes", *common, "--json", timeout_s=60).stdout)
    assert sorted((n["node"], n["slots"], n["connected"]) for n in nodes) == [
        ("node-a", 2, True),
        ("node-b", 2, True),
    ]

    jobs = json.loads(
        keel("jobs", "--controller", address, "--token-file", token, "--json", timeout_s=60).stdout
    )
    assert [(j["job"], j["state"], j["restarts"]) for j in jobs] == [("exits-3", "FAILED", 0)]

    events = keel("events", "exits-3", *common, timeout_s=60)
    assert events.returncode == 0 and " crash " in events.stdout
    assert "exited with code 3" in events.stdout

    # Events are kept in etcd: the next leader shows them, numbered as before.
    (first,) = cluster.controllers
    first.kill()
    first.wait()
    address = cluster.controller()
    again = [
        json.loads(line)
        for line in keel("events", "exits-3", *common, "--json", timeout_s=60).stdout.splitlines()
    ]
    assert [(e["kind"], e["seq"]) for e in again] == [("crash", "1")]
    assert "exited with code 3" in again[0]["reason"]

    (cluster.path / "wrong").write_text("nope")
    refused = keel(
        "status", "--controller", address, "--token-file", str(cluster.path / "wrong"), timeout_s=60
    )
    assert refused.returncode == 1 and "UNAUTHENTICATED: wrong token" in refused.stderr
