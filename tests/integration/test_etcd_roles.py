"""etcd least privilege against a real etcd with auth on (``keel etcd setup``): an
agent's certificate reaches only what an agent needs, the controller's everything the
controller does, and a `keel up --tls` cluster runs a job so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import etcd3
import grpc
import pytest
from click.testing import CliRunner

from common import keys, net
from common.etcd import EtcdCredentials, connect
from common.leader import LeaderWatch
from common.records import NodeRecord
from common.tls import resolve_tls
from orchestrator.controller.store import Store
from orchestrator.local.etcd_server import EmbeddedEtcd, etcd_binary, memory_backed_dir
from orchestrator.security import certs, etcd_roles, etcd_setup
from orchestrator.security.etcd_setup import etcd as etcd_cli
from tests.conftest import REPO, wait_for

NODES = ("node-0", "node-1")


@pytest.fixture
def authed(tmp_path):
    """An etcd taking certificates of a fresh CA only, set up by `keel etcd setup`
    with a user per node; yields (etcd, credentials of a party by file name)."""
    tls = tmp_path / "tls"
    certs.init(tls, agents=NODES)

    def party(name: str) -> EtcdCredentials:
        return EtcdCredentials(ca=tls / "ca.pem", cert=tls / f"{name}.pem", key=tls / f"{name}.key")

    with EmbeddedEtcd(data_parent=memory_backed_dir(), tls=resolve_tls(tls, "controller")) as etcd:
        args = ["setup", "--etcd-endpoints", etcd.endpoint, "--etcd-ca", str(tls / "ca.pem")]
        args += ["--etcd-cert", str(tls / "root.pem"), "--etcd-key", str(tls / "root.key")]
        for node in NODES:
            args += ["--agent", node]
        first = CliRunner().invoke(etcd_cli, args)
        assert first.exit_code == 0, first.output
        assert "created user keel-agent-node-1" in first.output
        assert "auth enabled" in first.output
        again = CliRunner().invoke(etcd_cli, args)  # safe to rerun: it keeps what exists
        assert again.exit_code == 0, again.output
        assert "kept    user keel-agent-node-1" in again.output
        yield etcd, party


def refused(call) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED, caught.value


def test_an_agents_certificate_may_not_write_a_job_a_checkpoint_the_leader_or_another_node(
    authed,
):
    etcd, party = authed
    agent = connect(etcd.endpoints, 5.0, party("agent-node-0"))
    for key in (
        keys.job_state("j"),
        keys.job_spec("j"),
        keys.checkpoint("j", 100),
        keys.plan("j", 1),
        keys.LEADER,
        keys.EPOCH,
        keys.node("node-1"),
        keys.cordon("node-0"),
    ):
        refused(lambda key=key: agent.put(key, b"{}"))
        refused(lambda key=key: agent.delete(key))
    refused(lambda: agent.get(keys.job_state("j")))
    refused(lambda: agent.get_prefix(keys.JOBS))
    # Nor take the leader key as a controller would, nor register another node.
    refused(lambda: Store(agent).campaign("rogue", "127.0.0.1:1", agent.lease(10).id))
    record = NodeRecord(host="h", slots=1, pid=1, lease_id=0)
    refused(lambda: agent.put(keys.node("node-1"), record.to_json()))
    # A certificate of the CA whose name etcd has no user for reaches nothing.
    reader = connect(etcd.endpoints, 5.0, party("reader"))
    refused(lambda: reader.get(keys.LEADER))
    agent.close()
    reader.close()


def test_an_agents_certificate_does_what_an_agent_does(authed):
    etcd, party = authed
    agent = connect(etcd.endpoints, 5.0, party("agent-node-0"))
    controller = Store(connect(etcd.endpoints, 5.0, party("controller")))
    seen = []
    watch = LeaderWatch(agent, on_change=seen.append).start()
    try:
        leader_lease = controller.client.lease(10)
        assert controller.campaign("c-1", "127.0.0.1:7000", leader_lease.id)
        wait_for(lambda: seen and seen[-1] and seen[-1].id == "c-1", 10, what="the leader seen")
        lease = agent.lease(10)  # granted and refreshed with no key permission
        record = NodeRecord(host="h", slots=1, pid=os.getpid(), lease_id=lease.id)
        controller.put_node("node-0", record, lease.id)
        assert lease.refresh()[0].TTL > 0
        # Revoked as it stops: its own record goes at once.
        lease.revoke()
        assert "node-0" not in controller.nodes()
        # Another node's lease cannot be revoked with this certificate.
        other = connect(etcd.endpoints, 5.0, party("agent-node-1")).lease(10)
        controller.put_node("node-1", record, other.id)
        refused(lambda: agent.revoke_lease(other.id))
        assert "node-1" in controller.nodes()
    finally:
        watch.stop()
        agent.close()


def test_the_shared_agent_certificate_follows_the_leader_and_keeps_its_lease_only(tmp_path):
    """Every agent one certificate (a DaemonSet's): no key its own, so its lease,
    holding its node record, outlives it until the TTL."""
    tls = tmp_path / "tls"
    certs.init(tls)

    def party(name: str) -> EtcdCredentials:
        return EtcdCredentials(ca=tls / "ca.pem", cert=tls / f"{name}.pem", key=tls / f"{name}.key")

    with EmbeddedEtcd(data_parent=memory_backed_dir(), tls=resolve_tls(tls, "controller")) as etcd:
        root = connect(etcd.endpoints, 5.0, party("root"))
        etcd_setup.apply(root, etcd_roles.roles())
        agent = connect(etcd.endpoints, 5.0, party("agent"))
        controller = Store(connect(etcd.endpoints, 5.0, party("controller")))
        assert controller.campaign("c-1", "127.0.0.1:7000", controller.client.lease(10).id)
        assert Store(agent).leader().id == "c-1"
        lease = agent.lease(10)
        controller.put_node("node-0", NodeRecord(host="h", slots=1, pid=1, lease_id=0), lease.id)
        assert lease.refresh()[0].TTL > 0
        refused(lease.revoke)
        refused(lambda: agent.put(keys.node("node-0"), b"{}"))
        refused(lambda: agent.put(keys.job_state("j"), b"{}"))
        assert "node-0" in controller.nodes()
        for client in (root, agent, controller.client):
            client.close()


def test_the_controllers_certificate_reads_and_writes_every_keel_key(authed):
    etcd, party = authed
    for name in ("controller", "operator"):
        client = connect(etcd.endpoints, 5.0, party(name))
        for key in (
            keys.LEADER,
            keys.EPOCH,
            keys.node("node-0"),
            keys.cordon("node-0"),
            keys.job_spec("j"),
            keys.job_state("j"),
            keys.plan_parts("j", 1, "d") + "0",
            keys.checkpoint("j", 5),
            keys.event("j", 1),
            keys.operation("j"),
            keys.checkpoint_request("j"),
        ):
            client.put(key, b"{}")
            assert client.get(key)[0] == b"{}"
            assert client.delete(key)
        assert list(client.get_prefix(keys.PREFIX + "/")) == []
        refused(lambda client=client: client.put("/not-keel", b"x"))
        client.close()


def test_keel_up_with_tls_runs_a_job_with_etcd_auth_on(no_leaks, tmp_path):
    """Two nodes, each its agent's own etcd user; the job waits for the test to have
    seen etcd refuse an agent's certificate and grant the operator's."""
    go = tmp_path / "go"
    script = tmp_path / "wait.py"
    script.write_text(
        "import pathlib, time\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n"
        "    time.sleep(0.1)\n"
    )
    workdir = no_leaks / "run"
    log = tmp_path / "up.log"
    with open(log, "wb") as err:
        up = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "up", "--json", "--tls"]
            + ["--workdir", str(workdir), "--nodes", "2", "--slots-per-node", "1"]
            + ["--no-preflight", "--script", str(script), "--timeout-s", "150"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    try:
        found = wait_for(
            lambda: re.search(r"--etcd-endpoints (\S+)", log.read_text()), 120, what="the job"
        )
        endpoints = found.group(1).split(",")
        tls = workdir / "tls"

        def party(name: str) -> EtcdCredentials:
            return EtcdCredentials(
                ca=tls / "ca.pem", cert=tls / f"{name}.pem", key=tls / f"{name}.key"
            )

        operator = Store(connect(endpoints, 5.0, party("operator")))
        job = wait_for(lambda: operator.job_names(), 30, what="the job in etcd")[0]
        assert set(operator.nodes()) == {"node-0", "node-1"}
        agent = connect(endpoints, 5.0, party("agent-node-1"))
        refused(lambda: agent.put(keys.job_state(job), b"{}"))
        refused(lambda: agent.get(keys.job_state(job)))
        agent.close()
        go.touch()
        out, _ = up.communicate(timeout=150)
    finally:
        go.touch()
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, log.read_text()[-4000:]
    assert json.loads(out)["state"] == "SUCCEEDED", out
    for node in NODES:
        text = (workdir / "logs" / f"agent-{node}.log").read_text()
        assert "could not revoke lease" not in text, text[-2000:]


def test_setup_refuses_an_etcd_that_takes_clients_without_a_certificate(no_leaks):
    """Its users log in by certificate only: on an etcd without --client-cert-auth,
    enabling auth would lock everyone out, root included."""
    tls = no_leaks / "tls"
    certs.init(tls)
    client_port, peer_port = net.free_port("127.0.0.1"), net.free_port("127.0.0.1")
    endpoint = f"127.0.0.1:{client_port}"
    with open(no_leaks / "etcd.log", "wb") as log:
        proc = subprocess.Popen(
            [str(etcd_binary()), "--name", "s", "--data-dir", str(no_leaks / "data")]
            + ["--listen-client-urls", f"https://{endpoint}"]
            + ["--advertise-client-urls", f"https://{endpoint}"]
            + ["--listen-peer-urls", f"http://127.0.0.1:{peer_port}"]
            + ["--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}"]
            + ["--initial-cluster", f"s=http://127.0.0.1:{peer_port}"]
            + ["--cert-file", str(tls / "controller.pem")]
            + ["--key-file", str(tls / "controller.key")]
            + ["--log-level", "warn"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        anyone = connect([endpoint], 5.0, EtcdCredentials(ca=tls / "ca.pem"))

        def serving() -> bool:
            try:
                return anyone.put("/probe", b"x") is not None
            except etcd3.exceptions.ConnectionFailedError:
                return False

        wait_for(serving, 20, what="etcd over TLS")
        result = CliRunner().invoke(
            etcd_cli,
            ["setup", "--etcd-endpoints", endpoint, "--etcd-ca", str(tls / "ca.pem")]
            + ["--etcd-cert", str(tls / "root.pem"), "--etcd-key", str(tls / "root.key")],
        )
        assert result.exit_code != 0
        assert "answers clients without a certificate" in result.output
        assert "--client-cert-auth" in result.output
        anyone.put(keys.job_state("j"), b"{}")  # auth is still off
        anyone.close()
    finally:
        proc.terminate()
        proc.wait(10)
