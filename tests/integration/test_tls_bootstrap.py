"""TLS bootstrapping against a real etcd, a real controller and real agents: an agent
given only ca.pem and the join token is signed its node's own certificate (after an
operator's approval, here), renews it before it expires, and from then on no one else
speaks for its node: not another key asking for its name, not another node's
certificate, not the shared agent certificate; a revoked node is cut off."""

from __future__ import annotations

import json
import shutil

from cryptography import x509

from common import net
from common.node_identity import bound_node
from orchestrator.security import certs
from tests.conftest import keel, wait_for
from tests.integration.conftest import spawn, stop

LIFETIME_S = 45  # renewed at 2/3: 30 s in


def test_a_node_bootstraps_renews_and_no_one_else_speaks_for_it(etcd, no_leaks):
    tmp = no_leaks
    tls = tmp / "tls"  # the operator's: the CA key stays here, off the nodes
    certs.init(tls)
    given = tmp / "given"  # what a node is given: the CA certificate and the join token
    given.mkdir()
    for name in ("ca.pem", "join.token"):
        shutil.copy(tls / name, given / name)
    port = net.free_port("127.0.0.1")
    started = []

    def log_of(name: str) -> str:
        return (tmp / f"{name}.log").read_text(errors="replace")

    controller = spawn(
        ["-m", "orchestrator.cli", "controller", "--etcd-endpoints", etcd.endpoint]
        + ["--tls-dir", str(tls), "--address-file", str(tmp / "address")]
        + ["--bootstrap-port", str(port), "--approve-agents"]
        + ["--agent-certificate-lifetime-s", str(LIFETIME_S)],
        tmp / "controller.log",
    )
    started.append(controller)

    def agent(name: str, node: str, *flags: str):
        proc = spawn(
            ["-m", "agent", "--node", node, "--slots", "1", "--etcd-endpoints", etcd.endpoint]
            + ["--run-dir", str(tmp / name), "--lease-ttl-s", "2", *flags],
            tmp / f"{name}.log",
        )
        started.append(proc)
        return proc

    def bootstrapping(name: str, node: str):
        return agent(
            name,
            node,
            "--tls-dir",
            str(given),
            "--bootstrap-address",
            f"127.0.0.1:{port}",
            "--cert-dir",
            str(tmp / name / "identity"),
        )

    operator = ["--etcd-endpoints", etcd.endpoint, "--tls-dir", str(tls)]

    def certificates() -> dict:
        listed = keel("certs", "list", "--json", *operator)
        assert listed.returncode == 0, listed.stderr
        return {c["node"]: c for c in json.loads(listed.stdout)}

    def connected() -> set:
        listed = keel("nodes", "--json", *operator)
        assert listed.returncode == 0, listed.stderr
        return {n["node"] for n in json.loads(listed.stdout) if n.get("connected")}

    try:
        wait_for(lambda: (tmp / "address").exists(), 30, what="the controller serving")
        node_a = bootstrapping("node-a", "node-a")
        bootstrapping("node-b", "node-b")
        # --approve-agents: each first request waits for an operator.
        wait_for(
            lambda: (
                {c["state"] for c in certificates().values()} == {"pending"}
                and len(certificates()) == 2
            ),
            30,
            what="both requests recorded, pending",
        )
        assert "waiting for certificate approval" in log_of("node-a")
        assert not connected()
        for node in ("node-a", "node-b"):
            approved = keel("certs", "approve", node, *operator)
            assert approved.returncode == 0, approved.stderr
            assert "approved" in approved.stdout
        wait_for(lambda: connected() == {"node-a", "node-b"}, 30, what="both agents connected")
        issued = certificates()["node-a"]
        assert (issued["state"], issued["issued"]) == ("issued", 1)
        pem = tmp / "node-a" / "identity" / "agent-node-a.pem"
        cert = x509.load_pem_x509_certificate(pem.read_bytes())
        assert bound_node(cert) == "node-a"
        key = tmp / "node-a" / "identity" / "agent-node-a.key"
        assert key.stat().st_mode & 0o777 == 0o600
        assert not (given / "agent.pem").exists()  # it was never given one

        # Another key asks for node-a's name with the join token: refused, and the
        # agent says so and exits; node-a keeps its session.
        thief = bootstrapping("thief", "node-a")
        assert thief.wait(30) != 0
        assert "already has its certificate" in log_of("thief")
        # node-b's certificate presented for node-a: refused at Hello.
        agent(
            "impostor",
            "node-a",
            "--ca",
            str(given / "ca.pem"),
            "--cert",
            str(tmp / "node-b" / "identity" / "agent-node-b.pem"),
            "--key",
            str(tmp / "node-b" / "identity" / "agent-node-b.key"),
            "--token-file",
            str(given / "join.token"),
        )
        wait_for(
            lambda: (
                "the certificate of node node-b cannot say Hello for node node-a"
                in log_of("controller")
            ),
            30,
            what="the impostor refused",
        )
        # The shared agent certificate, for a node that has its own: refused too.
        agent(
            "shared",
            "node-b",
            "--tls-dir",
            str(tls),
            "--cert",
            str(tls / "agent.pem"),
            "--key",
            str(tls / "agent.key"),
        )
        wait_for(
            lambda: "node node-b has its own certificate" in log_of("controller"),
            30,
            what="the shared certificate refused",
        )
        assert connected() == {"node-a", "node-b"}
        assert log_of("controller").count('"node": "node-a", "slots"') == 1  # one session

        # Renewal, before it expires: the same key signed again, and the agent goes on.
        wait_for(lambda: "certificate renewed" in log_of("node-a"), LIFETIME_S, what="a renewal")
        renewed = x509.load_pem_x509_certificate(pem.read_bytes())
        assert renewed.serial_number != cert.serial_number
        assert renewed.public_key().public_numbers() == cert.public_key().public_numbers()
        # Not before 2/3 of the first one's lifetime (give or take the signing skew).
        waited = renewed.not_valid_before_utc - cert.not_valid_before_utc
        assert waited.total_seconds() >= 0.6 * LIFETIME_S, waited
        assert log_of("node-a").count("certificate renewed") == 1
        assert certificates()["node-a"]["issued"] == 2

        # Revoked: node-a's session is closed at once, and it is not let back in.
        revoked = keel("certs", "revoke", "node-a", *operator)
        assert revoked.returncode == 0, revoked.stderr
        wait_for(lambda: "node-a" not in connected(), 15, what="node-a's session closed")
        wait_for(
            lambda: "node node-a's certificate was revoked" in log_of("controller"),
            30,
            what="node-a's Hello refused",
        )
        assert node_a.poll() is None  # it keeps asking; an operator decides
        assert certificates()["node-a"]["state"] == "revoked"
    finally:
        for proc in reversed(started):
            stop(proc)
