"""The controller signs a bootstrapping node's request into a certificate bound to that
node only, and the agent knows when its certificate needs renewing."""

import datetime

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from agent.bootstrap import Identity, renewal_due
from common.node_identity import bound_node, certificate_request, common_name, key_sha256
from orchestrator.security import certs
from orchestrator.security.auth import presented_certificate
from orchestrator.security.certs import NodeSigner, RequestError

NOW = datetime.datetime(2026, 12, 6, tzinfo=datetime.UTC)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    certs.init(directory, agents=("n0",))
    return directory


def test_a_request_is_signed_as_its_node_with_nothing_else_taken(tls):
    signer = NodeSigner(tls / "ca.pem", tls / "ca.key")
    key = ec.generate_private_key(ec.SECP256R1())
    request = signer.check("n1", certificate_request("n1", key))
    cert = signer.sign("n1", request, 3600.0, now=NOW)
    assert bound_node(cert) == "n1"
    assert common_name(cert) == "keel-agent"  # etcd's user of every agent, not a CN asked for
    assert key_sha256(cert.public_key()) == key_sha256(key.public_key())
    assert cert.not_valid_after_utc - NOW == datetime.timedelta(hours=1)
    assert NOW - cert.not_valid_before_utc == datetime.timedelta(seconds=180)  # 1/20 of it
    pem = cert.public_bytes(certs.serialization.Encoding.PEM)
    presented = presented_certificate({"x509_pem_cert": [pem]})
    assert presented.bound == "n1" and presented.key_sha256 == key_sha256(key.public_key())
    assert presented_certificate({}) is None  # plaintext


def test_a_request_naming_another_node_or_not_a_request_is_refused(tls):
    signer = NodeSigner(tls / "ca.pem", tls / "ca.key")
    key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(RequestError, match="names node n2"):
        signer.check("n1", certificate_request("n2", key))
    with pytest.raises(RequestError, match="not a PEM certificate request"):
        signer.check("n1", b"junk")
    with pytest.raises(RequestError, match="letters, digits"):
        signer.check("../n1", certificate_request("n1", key))
    with pytest.raises(ValueError, match="not the key of the CA"):
        NodeSigner(tls / "ca.pem", tls / "controller.key")


def test_the_shared_and_the_per_agent_certificates_bind_what_they_say(tls):
    from cryptography import x509

    def load(name):
        return x509.load_pem_x509_certificate((tls / name).read_bytes())

    assert bound_node(load("agent-n0.pem")) == "n0"
    assert bound_node(load("operator.pem")) is None


def test_renewal_is_due_without_a_good_certificate_or_past_two_thirds(tls, tmp_path):
    signer = NodeSigner(tls / "ca.pem", tls / "ca.key")
    identity = Identity(tmp_path / "id", "n1", tls / "ca.pem")
    assert (tmp_path / "id" / "agent-n1.key").stat().st_mode & 0o777 == 0o600
    key = identity.key
    assert Identity(tmp_path / "id", "n1", tls / "ca.pem").key.private_numbers() == (
        key.private_numbers()
    )  # kept, never made again
    cert = signer.sign("n1", signer.check("n1", certificate_request("n1", key)), 3000.0, now=NOW)
    start = cert.not_valid_before_utc
    assert renewal_due(None, key, "n1", NOW) == "no certificate yet"
    assert renewal_due(cert, key, "n1", NOW) == ""
    assert "for node n1, not n2" in renewal_due(cert, key, "n2", NOW)
    other = ec.generate_private_key(ec.SECP256R1())
    assert "not for this node's key" in renewal_due(cert, other, "n1", NOW)
    life = cert.not_valid_after_utc - start
    assert renewal_due(cert, key, "n1", start + life * 0.66) == ""
    assert "past 67%" in renewal_due(cert, key, "n1", start + life * 0.67)
    assert "expired" in renewal_due(cert, key, "n1", cert.not_valid_after_utc)
