"""Mutual TLS and role tokens with a real etcd, a real controller and real agents."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from common import net
from common.etcd import connect
from common.tls import call_metadata
from orchestrator.controller.store import Store
from orchestrator.local.etcd_server import etcd_binary
from orchestrator.security import certs
from protos import keel_pb2, keel_pb2_grpc
from tests.conftest import enable_etcd_auth, etcdctl, keel, wait_for
from tests.integration.conftest import spawn, stop
from tests.integration.test_keel_up import run_up


@pytest.fixture
def secure(etcd, no_leaks):
    tmp = no_leaks
    tls_dir = tmp / "tls"
    certs.init(tls_dir, agents=("node-a", "intruder", "reader-as-agent"))
    started = []

    def controller():
        proc = spawn(
            [
                "-m",
                "orchestrator.cli",
                "controller",
                "--etcd-endpoints",
                etcd.endpoint,
                "--tls-dir",
                str(tls_dir),
                "--address-file",
                str(tmp / "address"),
                "--metrics-listen",
                ":0",
                "--metrics-address-file",
                str(tmp / "metrics"),
            ],
            tmp / "controller.log",
        )
        started.append(proc)
        wait_for(
            lambda: (tmp / "address").exists() or proc.poll() is not None,
            30,
            what="controller address",
        )
        assert proc.poll() is None, (tmp / "controller.log").read_text()
        return (tmp / "address").read_text().strip()

    def agent(node, *extra):
        proc = spawn(
            [
                "-m",
                "agent",
                "--node",
                node,
                "--slots",
                "1",
                "--etcd-endpoints",
                etcd.endpoint,
                "--tls-dir",
                str(tls_dir),
                "--run-dir",
                str(tmp / node),
                "--lease-ttl-s",
                "2",
                *extra,
            ],
            tmp / f"{node}.log",
        )
        started.append(proc)
        return proc

    class Secure:
        store = Store(connect([etcd.endpoint], 5))
        path, tls = tmp, tls_dir
        token = staticmethod(lambda role: (tls_dir / f"{role}.token").read_text().strip())

    Secure.controller, Secure.agent = staticmethod(controller), staticmethod(agent)
    yield Secure
    for proc in reversed(started):
        stop(proc)


def credentials(tls_dir, party="operator", trust=None):
    return grpc.ssl_channel_credentials(
        root_certificates=((trust or tls_dir) / "ca.pem").read_bytes(),
        private_key=(tls_dir / f"{party}.key").read_bytes(),
        certificate_chain=(tls_dir / f"{party}.pem").read_bytes(),
    )


def keel_state(store) -> list:
    return [
        (meta.key, value, meta.mod_revision) for value, meta in store.client.get_prefix("/keel/")
    ]


def test_mutual_tls_and_role_tokens(secure, etcd):
    address = secure.controller()
    secure.agent("node-a")
    (secure.path / "wrong").write_text("not-the-join-token")
    secure.agent("intruder", "--token-file", str(secure.path / "wrong"))
    secure.agent("reader-as-agent", "--token-file", str(secure.tls / "reader.token"))
    # The right token, but node-a's own certificate: it registers node-a only.
    secure.agent(
        "node-b",
        "--cert",
        str(secure.tls / "agent-node-a.pem"),
        "--key",
        str(secure.tls / "agent-node-a.key"),
    )
    wait_for(lambda: "node-a" in secure.store.nodes(), 30, what="node-a to register")
    wait_for(
        lambda: b"UNAUTHENTICATED" in (secure.path / "intruder.log").read_bytes(),
        30,
        what="the wrong join token to be refused",
    )
    wait_for(
        lambda: (
            b"the reader token cannot call Connect; use the join token"
            in (secure.path / "reader-as-agent.log").read_bytes()
        ),
        30,
        what="the reader token to be refused as a join token",
    )
    wait_for(
        lambda: (
            b"the certificate of node node-a cannot say Hello for node node-b"
            in (secure.path / "node-b.log").read_bytes()
        ),
        30,
        what="node-a's certificate to be refused for node-b",
    )
    assert set(secure.store.nodes()) == {"node-a"}

    spec = keel_pb2.JobSpec(name="ok-name", world_size=1, command=["true"])
    submit = keel_pb2.SubmitJobRequest(spec=spec)
    operator = call_metadata(secure.token("operator"))
    before = keel_state(secure.store)

    # No client certificate, or one from another CA: the TLS handshake fails, so the
    # call never reaches the token check, whatever token it carries.
    other = secure.path / "other-ca"
    certs.init(other)
    for name, channel in [
        ("plaintext", grpc.insecure_channel(address)),
        (
            "no client certificate",
            grpc.secure_channel(
                address,
                grpc.ssl_channel_credentials(
                    root_certificates=(secure.tls / "ca.pem").read_bytes()
                ),
            ),
        ),
        (
            "certificate of another CA",
            grpc.secure_channel(address, credentials(other, trust=secure.tls)),
        ),
    ]:
        with channel:
            stub = keel_pb2_grpc.ControllerStub(channel)
            for call, request in [
                ("SubmitJob", submit),
                ("ListNodes", keel_pb2.ListNodesRequest()),
            ]:
                with pytest.raises(grpc.RpcError) as err:
                    getattr(stub, call)(request, metadata=operator, timeout=5)
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE, name
    assert keel_state(secure.store) == before

    with grpc.secure_channel(address, credentials(secure.tls, "reader")) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        reader = call_metadata(secure.token("reader"))
        nodes = stub.ListNodes(keel_pb2.ListNodesRequest(), metadata=reader, timeout=5).nodes
        assert [(n.node, n.connected) for n in nodes] == [("node-a", True)]
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(submit, metadata=reader, timeout=5)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert (
            err.value.details() == "the reader token cannot call SubmitJob; use the operator token"
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.ListNodes(
                keel_pb2.ListNodesRequest(), metadata=call_metadata(secure.token("join")), timeout=5
            )
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(submit, metadata=call_metadata("guess"), timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert keel_state(secure.store) == before

    with grpc.secure_channel(address, credentials(secure.tls, "operator")) as channel:
        stub = keel_pb2_grpc.ControllerStub(channel)
        stub.SubmitJob(submit, metadata=operator, timeout=5)
    assert secure.store.job_spec("ok-name") is not None

    # The CLI finds the controller through etcd and, handed only a reader's files,
    # reads as the reader.
    reader_dir = secure.path / "reader-only"
    reader_dir.mkdir()
    for name in ("ca.pem", "reader.pem", "reader.key", "reader.token"):
        shutil.copy(secure.tls / name, reader_dir / name)
    listed = keel(
        "nodes",
        "--etcd-endpoints",
        etcd.endpoint,
        "--tls-dir",
        str(reader_dir),
        "--json",
        timeout_s=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert [n["node"] for n in json.loads(listed.stdout)] == ["node-a"]
    # ... and cannot steer: a mutating command is refused and changes nothing.
    refused = keel(
        "drain",
        "node-a",
        "--etcd-endpoints",
        etcd.endpoint,
        "--tls-dir",
        str(reader_dir),
        timeout_s=60,
    )
    assert refused.returncode == 1
    assert "the reader token cannot call DrainNode; use the operator token" in refused.stderr
    assert secure.store.cordons() == {}

    # Its metrics are HTTPS with the controller's certificate, to holders of a
    # certificate of the same CA only.
    metrics = f"https://{(secure.path / 'metrics').read_text().strip()}/metrics"
    trusting = ssl.create_default_context(cafile=str(secure.tls / "ca.pem"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(metrics, context=trusting, timeout=10).read()
    trusting.load_cert_chain(secure.tls / "reader.pem", secure.tls / "reader.key")
    with urllib.request.urlopen(metrics, context=trusting, timeout=10) as reply:
        assert b"keel_controller_leader 1.0" in reply.read()
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(metrics.replace("https:", "http:"), timeout=10).read()


def test_keel_up_with_tls(no_leaks):
    summary = run_up(
        no_leaks / "run",
        "--tls",
        "--nodes",
        "1",
        "--slots-per-node",
        "1",
        "--steps",
        "5",
        "--no-preflight",
        timeout_s=120,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert (summary["state"], summary["steps"]) == ("SUCCEEDED", 5)
    tls_dir = no_leaks / "run" / "tls"
    assert (tls_dir / "ca.pem").exists() and (tls_dir / "join.token").exists()
    serving = next(
        json.loads(line)
        for line in (no_leaks / "run" / "logs" / "controller.log").read_text().splitlines()
        if '"controller serving"' in line
    )
    assert serving["mutual_tls"] and serving["role_tokens"]
    # Its embedded etcd served TLS to certificate holders only; keel up told how to reach it.
    assert f"--etcd-cert {tls_dir / 'operator.pem'}" in summary["_stderr"]
    # Without --rank-user its ranks ran as keel up's user, which it said once.
    said = [line for line in summary["_stderr"].splitlines() if "ranks run as" in line]
    assert (
        len(said) == 1
        and f"can read the cluster's keys and tokens in {tls_dir.parent}" in (said[0])
    ), said


def test_keel_ups_embedded_etcd_with_tls_takes_only_clients_with_a_certificate(tmp_path):
    """`keel up --tls` runs its etcd with TLS and client certificates, so that no one
    who merely reaches its port can rewrite every job."""
    from common.tls import resolve_tls
    from orchestrator.local.etcd_server import EmbeddedEtcd

    tls_dir = tmp_path / "tls"
    certs.init(tls_dir)
    with EmbeddedEtcd(data_parent=tmp_path, tls=resolve_tls(tls_dir, "controller")) as server:
        endpoint = f"https://{server.endpoint}"
        plain = subprocess.run(
            etcdctl(f"http://{server.endpoint}", "get", "/x"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        no_cert = subprocess.run(
            etcdctl(endpoint, "--cacert", str(tls_dir / "ca.pem"), "get", "/x"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        with_cert = subprocess.run(
            etcdctl(
                endpoint,
                "--cacert",
                str(tls_dir / "ca.pem"),
                "--cert",
                str(tls_dir / "agent.pem"),
                "--key",
                str(tls_dir / "agent.key"),
                "put",
                "/x",
                "1",
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert plain.returncode != 0 and no_cert.returncode != 0, (plain.stderr, no_cert.stderr)
    assert with_cert.returncode == 0, with_cert.stderr


@pytest.fixture
def secure_etcd(no_leaks):
    """etcd over TLS demanding client certificates (signed by a `keel certs init` CA),
    with authentication on and a user ``keel`` that may only touch /keel/."""
    tls_dir = no_leaks / "etcd-tls"
    certs.init(tls_dir)
    client_port, peer_port = net.free_port("127.0.0.1"), net.free_port("127.0.0.1")
    endpoint = f"127.0.0.1:{client_port}"
    server = [str(tls_dir / "controller.pem"), str(tls_dir / "controller.key")]
    # etcd keeps its own copy of the log's descriptor; ours is closed at once.
    with open(no_leaks / "etcd.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(etcd_binary()),
                "--name",
                "s",
                "--data-dir",
                str(no_leaks / "etcd-data"),
                "--listen-client-urls",
                f"https://{endpoint}",
                "--advertise-client-urls",
                f"https://{endpoint}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"s=http://127.0.0.1:{peer_port}",
                "--cert-file",
                server[0],
                "--key-file",
                server[1],
                "--client-cert-auth",
                "--trusted-ca-file",
                str(tls_dir / "ca.pem"),
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    ctl = etcdctl(
        f"https://{endpoint}",
        "--cacert",
        str(tls_dir / "ca.pem"),
        "--cert",
        server[0],
        "--key",
        server[1],
    )
    try:
        wait_for(
            lambda: (
                subprocess.run([*ctl, "endpoint", "health"], capture_output=True).returncode == 0
            ),
            20,
            0.1,
            what="etcd over TLS",
        )
        enable_etcd_auth(ctl)
        yield endpoint, tls_dir
    finally:
        stop(proc)


def test_controller_agent_and_cli_reach_etcd_over_tls_with_a_user(
    secure_etcd, no_leaks, monkeypatch
):
    endpoint, etcd_tls = secure_etcd
    tmp = no_leaks
    (tmp / "token").write_text("one-token")
    etcd_flags = [
        "--etcd-ca",
        str(etcd_tls / "ca.pem"),
        "--etcd-cert",
        str(etcd_tls / "agent.pem"),
        "--etcd-key",
        str(etcd_tls / "agent.key"),
        "--etcd-user",
        "keel",
    ]
    monkeypatch.setenv("KEEL_ETCD_PASSWORD", "keel-pw")
    procs = [
        spawn(
            [
                "-m",
                "orchestrator.cli",
                "controller",
                "--etcd-endpoints",
                endpoint,
                "--token-file",
                str(tmp / "token"),
                *etcd_flags,
            ],
            tmp / "controller.log",
        ),
        spawn(
            [
                "-m",
                "agent",
                "--node",
                "node-a",
                "--slots",
                "1",
                "--etcd-endpoints",
                endpoint,
                "--token-file",
                str(tmp / "token"),
                "--run-dir",
                str(tmp / "node-a"),
                *etcd_flags,
            ],
            tmp / "node-a.log",
        ),
    ]
    try:
        listed = None

        def node_listed():
            nonlocal listed
            listed = keel(
                "nodes",
                "--etcd-endpoints",
                endpoint,
                "--token-file",
                str(tmp / "token"),
                "--json",
                *etcd_flags,
                timeout_s=60,
            )
            return listed.returncode == 0 and json.loads(listed.stdout)

        nodes = wait_for(node_listed, 30, 0.2, what="the node listed through etcd")
        assert [n["node"] for n in nodes] == ["node-a"]
        # Without the user, etcd takes the certificate's name, which has no rights.
        monkeypatch.delenv("KEEL_ETCD_PASSWORD")
        refused = keel(
            "nodes",
            "--etcd-endpoints",
            endpoint,
            "--token-file",
            str(tmp / "token"),
            *etcd_flags[:6],
            timeout_s=60,
        )
        assert refused.returncode != 0 and "permission denied" in refused.stderr
    finally:
        for proc in reversed(procs):
            stop(proc)

    # keel up hands the same credentials to its controller, agents and own etcd client.
    monkeypatch.setenv("KEEL_ETCD_PASSWORD", "keel-pw")
    summary = run_up(
        tmp / "up",
        "--etcd-endpoints",
        endpoint,
        *etcd_flags,
        "--nodes",
        "1",
        "--slots-per-node",
        "1",
        "--steps",
        "3",
        "--no-preflight",
        timeout_s=120,
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    assert summary["state"] == "SUCCEEDED"
