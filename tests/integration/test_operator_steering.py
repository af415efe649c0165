"""Steering a running job from the command line: submit a spec file, checkpoint,
cordon, replace, drain and stop, against a real controller, agents and trainer ranks."""

from __future__ import annotations

import json
import sys

from tests.conftest import keel, wait_for

SPEC = """\
name = "steer"
world_size = 2
max_restarts = 0
checkpoint_dir = "{checkpoints}"
command = ["{python}", "-u", "-m", "trainer.train", "--steps", "100000",
           "--checkpoint-every", "100000", "--dim=32", "--layers=1", "--heads=2",
           "--vocab=64", "--seq-len=16", "--global-batch=4"]

[health]
preflight_off = true
# Steps of a few ms on a shared 2-core machine are noisy: report slow nodes, never act.
straggler_policy = "alert"
"""


def test_an_operator_steers_a_running_job_from_the_cli(cluster, etcd):
    cluster.controller()
    for node in ("node-a", "node-b", "node-c"):
        cluster.agent(node, slots="1")
    wait_for(lambda: len(cluster.store.nodes()) == 3, 30, what="three nodes registered")
    common = ["--etcd-endpoints", etcd.endpoint, "--token-file", str(cluster.path / "token")]

    def cli(*args, ok=True):
        result = keel(*args, *common, timeout_s=120)
        assert (result.returncode == 0) == ok, result.stderr + result.stdout
        return result

    def job():
        return json.loads(cli("jobs", "--json").stdout)[0]

    def nodes():
        return {n["node"]: n for n in json.loads(cli("nodes", "--json").stdout)}

    def running_on(generation):
        found = job()
        return (
            found["state"] == "RUNNING"
            and int(found["generation"]) == generation
            and int(found["step"]) > 0
            and found
        )

    # A broken spec is refused with the field and the fix, and nothing is submitted.
    bad = cluster.path / "bad.toml"
    bad.write_text('name = "steer"\nworld_size = "two"\nmax_restart = 1\ncommand = "python"\n')
    refused = cli("submit", str(bad), ok=False)
    assert "world_size: expected an integer" in refused.stderr
    assert "unknown field 'max_restart'; did you mean 'max_restarts'?" in refused.stderr
    assert "command: expected a list" in refused.stderr
    assert cluster.store.job_names() == []

    spec = cluster.path / "steer.toml"
    spec.write_text(SPEC.format(checkpoints=cluster.path / "checkpoints", python=sys.executable))
    assert "submitted job steer (2 ranks)" in cli("submit", str(spec)).stdout
    wait_for(lambda: running_on(1), 120, 0.5, what="generation 1 stepping")
    assert {n: v["job"] for n, v in nodes().items()} == {
        "node-a": "steer",
        "node-b": "steer",
        "node-c": "",
    }

    # A checkpoint on demand, committed after the step at which it was asked for.
    asked = json.loads(cli("checkpoint", "--json").stdout)
    done = json.loads(cli("checkpoint", "steer", "--wait", "--timeout-s", "60", "--json").stdout)
    assert int(done["step"]) > int(asked["after_step"])

    # Cordon and uncordon a free node: persisted in etcd, shown by `keel nodes`.
    assert "node-c cordoned" in cli("cordon", "node-c", "--reason", "bad fan").stdout
    assert nodes()["node-c"]["state"] == "cordoned"
    assert "3/3 nodes connected, 3 slots, 1 job(s), 1 cordoned" in cli("status").stdout
    assert "bad fan" in cluster.store.cordons()["node-c"].reason
    refused = cli("replace", "node-b", "--with", "node-c", ok=False)
    assert "node-c cannot take node-b's place: it is cordoned" in refused.stderr
    refused = cli("replace", "node-b", ok=False)
    assert "no free node can take node-b's 1 rank(s)" in refused.stderr
    cli("uncordon", "node-c")
    assert nodes()["node-c"]["state"] == "ready" and cluster.store.cordons() == {}

    # Replace node-b by node-c: checkpoint, then generation 2 on node-a and node-c.
    cli("replace", "node-b", "--with", "node-c")
    wait_for(lambda: running_on(2), 120, 0.5, what="generation 2 stepping")
    assert {n for n, v in nodes().items() if v["job"] == "steer"} == {"node-a", "node-c"}
    assert nodes()["node-b"]["state"] == "ready"

    # Drain node-a: generation 3 runs on the free node-b; node-a ends drained.
    drained = cli("drain", "node-a", "--wait", "--timeout-s", "120")
    assert "runs without it on free nodes (1 slot(s) free, 1 needed)" in drained.stdout
    assert "node-a drained" in drained.stdout
    found = wait_for(lambda: running_on(3), 120, 0.5, what="generation 3 stepping")
    assert {n for n, v in nodes().items() if v["job"] == "steer"} == {"node-b", "node-c"}
    assert nodes()["node-a"]["state"] == "drained"
    # Both moves were planned around a checkpoint: neither spent one of the job's
    # max_restarts (0), and no failure was recorded.
    assert (found["restarts"], found["failures"]) == (0, [])

    # Stop: a final checkpoint, every rank stopped, the job CANCELLED for good.
    before = job()["last_checkpoint"]["step"]
    stopped = json.loads(
        cli("stop", "steer", "--reason", "done testing", "--wait", "--json").stdout
    )
    assert stopped["state"] == "CANCELLED"
    final = job()
    assert final["state"] == "CANCELLED" and "done testing" in final["reason"]
    assert int(final["last_checkpoint"]["step"]) > int(before)
    assert {v["job"] for v in nodes().values()} == {""}
    kinds = [
        json.loads(line)["kind"] for line in cli("events", "steer", "--json").stdout.splitlines()
    ]
    assert kinds.count("operator") >= 4 and "replaced" in kinds
