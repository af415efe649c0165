"""A node's own identity, as its certificate carries it: what the agent asks for (a
certificate request naming its node) and what the controller reads back from the
certificate an agent presents.

Two kinds of certificate bind a node, both signed by the cluster's CA:

- one that ``keel certs init --agent NODE`` wrote: common name ``keel-agent-NODE``
  (etcd, with ``--client-cert-auth``, takes it as the node's own user);
- one the controller signed for an agent that bootstrapped (``RequestCertificate``):
  common name ``keel-agent`` (etcd's user of every agent: the leader key, read only,
  and leases) and the node in a URI subject alternative name, ``urn:keel:node:NODE``.

A certificate with neither binds no node: the shared agent certificate, accepted only
behind the controller's ``--allow-shared-agent-certificate``.

Agents also serve each other (``agent.peer``): an agent's certificate is good for a
server too, under the DNS name ``NODE.agent.keel`` (``peer_name``; the shared one under
``*.agent.keel``), and an agent calling its partner checks that name, not the address
it dials: the partner it was told of answers, not another node that took its address.
"""

from __future__ import annotations

import datetime
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.keys import NODE_NAME, NODE_NAME_RULE

AGENT_CERT_PREFIX = "keel-agent-"  # then the node: ``keel certs init --agent NODE``
SHARED_AGENT_NAME = "keel-agent"  # the common name of every bootstrapped certificate
NODE_URI_PREFIX = "urn:keel:node:"


def node_uri(node: str) -> str:
    return NODE_URI_PREFIX + node


PEER_DOMAIN = "agent.keel"


def peer_name(node: str) -> str:
    """The DNS name node ``node``'s agent serves its peers under, in its certificate."""
    return f"{node}.{PEER_DOMAIN}"


def key_sha256(public_key) -> str:
    """The SHA-256 (hex) of a public key's DER form: what a node's record keeps."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def bound_node(cert: x509.Certificate) -> str | None:
    """The node ``cert`` speaks for, or None if it binds none (the shared one)."""
    name = common_name(cert)
    if name.startswith(AGENT_CERT_PREFIX):
        return name[len(AGENT_CERT_PREFIX) :]
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(NODE_URI_PREFIX):
            return uri[len(NODE_URI_PREFIX) :]
    return None


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def certificate_request(node: str, key: ec.EllipticCurvePrivateKey) -> bytes:
    """A PEM certificate request for node ``node``, signed by ``key`` (which proves the
    requester holds it). The controller takes only its public key and its node."""
    if not NODE_NAME.match(node):
        raise ValueError(f"node {node!r}: {NODE_NAME_RULE}")
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SHARED_AGENT_NAME)]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(node_uri(node))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM)


def lifetime_used(cert: x509.Certificate, now: datetime.datetime) -> float:
    """The share of ``cert``'s validity gone by ``now`` (0 before, past 1 after it)."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    total = (end - start).total_seconds()
    return (now - start).total_seconds() / total if total > 0 else 1.0
