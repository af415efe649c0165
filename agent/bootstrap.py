"""TLS bootstrapping, the agent's side: with only the CA certificate and the join token,
the agent makes its node's key, asks the controller's ``Bootstrap`` port for a
certificate bound to its node (``orchestrator.controller.bootstrap``), keeps both in
its certificate directory, and asks again with the same key before the certificate
expires (``RENEW_AT`` of its lifetime; the controller signs the same key again).

The certificate is what the agent presents to the controller: ``common.rpc.channel``
reads the files at every connect, so a renewed certificate is presented from the
agent's next reconnect on (the one it replaces stays valid until then). etcd is
reached with the etcd flags' own credentials.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from common.node_identity import bound_node, certificate_request, key_pem, key_sha256, new_key
from common.paths import write_atomically
from common.tls import TlsFiles, call_metadata
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

RENEW_AT = 2 / 3  # of a certificate's lifetime: then the agent asks for the next
CALL_TIMEOUT_S = 10.0
PENDING_POLL_S = 2.0
RETRY_MAX_S = 5.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024)]
# A refusal: asking again the same way gets the same answer.
REFUSALS = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
)


class CertificateRefused(Exception):
    """The controller refused the node's certificate request; the message says why."""


def renewal_due(cert: x509.Certificate | None, key, node: str, now: datetime.datetime) -> str:
    """Why the node needs a (new) certificate, or "" while ``cert`` serves."""
    if cert is None:
        return "no certificate yet"
    if bound_node(cert) != node:
        return f"the certificate is for node {bound_node(cert)}, not {node}"
    if key_sha256(cert.public_key()) != key_sha256(key.public_key()):
        return "the certificate is not for this node's key"
    if now >= cert.not_valid_after_utc:
        return "the certificate expired"
    if now < cert.not_valid_before_utc:
        return "the certificate is not valid yet"
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now >= start + (end - start) * RENEW_AT:
        return f"past {RENEW_AT:.0%} of the certificate's lifetime"
    return ""


class Identity:
    """Node ``node``'s key and certificate in ``cert_dir``: ``agent-<node>.key`` (made
    once, 0600, never replaced) and ``agent-<node>.pem``."""

    def __init__(self, cert_dir: Path, node: str, ca: Path):
        self.node, self.ca = node, Path(ca)
        self.dir = Path(cert_dir)
        self.key_path = self.dir / f"agent-{node}.key"
        self.cert_path = self.dir / f"agent-{node}.pem"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.key = self._key()

    def _key(self):
        if self.key_path.exists():
            return serialization.load_pem_private_key(self.key_path.read_bytes(), None)
        key = new_key()
        fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key_pem(key))
        return key

    def certificate(self) -> x509.Certificate | None:
        try:
            return x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        except (OSError, ValueError):
            return None

    def due(self) -> str:
        return renewal_due(self.certificate(), self.key, self.node, _now())

    def files(self) -> TlsFiles:
        return TlsFiles(self.ca, self.cert_path, self.key_path)

    def keep(self, pem: bytes) -> x509.Certificate:
        """Check the controller's answer and keep it (whole or not at all)."""
        cert = x509.load_pem_x509_certificate(pem)
        problem = renewal_due(cert, self.key, self.node, _now())
        if problem and not problem.startswith("past"):
            raise CertificateRefused(f"the controller's certificate will not do: {problem}")
        write_atomically(self.cert_path, pem.decode())
        self.cert_path.chmod(0o644)
        return cert


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def request_once(
    addresses: list[str], identity: Identity, token: str
) -> keel_pb2.CertificateReply | None:
    """One pass over the bootstrap addresses: the first answer (a certificate, or
    pending), None if none could answer; raises CertificateRefused on a refusal."""
    request = keel_pb2.CertificateRequest(
        node=identity.node, csr_pem=certificate_request(identity.node, identity.key)
    )
    credentials = grpc.ssl_channel_credentials(root_certificates=identity.ca.read_bytes())
    for address in addresses:
        with grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS) as channel:
            try:
                return keel_pb2_grpc.BootstrapStub(channel).RequestCertificate(
                    request, timeout=CALL_TIMEOUT_S, metadata=call_metadata(token)
                )
            except grpc.RpcError as exc:
                if exc.code() in REFUSALS:
                    raise CertificateRefused(f"{address}: {exc.details()}") from None
                log.warning(
                    "bootstrap address did not answer",
                    address=address,
                    code=str(exc.code()),
                    details=exc.details(),
                )
    return None


def obtain(
    addresses: list[str], identity: Identity, token: str, stopping: threading.Event
) -> x509.Certificate | None:
    """Ask until the node holds its certificate (None if ``stopping`` is set first):
    through a pending approval and controllers that do not answer."""
    wait, told_at = 0.5, -1e9
    while not stopping.is_set():
        reply = request_once(addresses, identity, token)
        if reply is not None and reply.certificate_pem:
            return identity.keep(reply.certificate_pem)
        if reply is not None:  # pending
            if time.monotonic() - told_at > 60:
                log.warning("waiting for certificate approval", message=reply.message)
                told_at = time.monotonic()
            stopping.wait(PENDING_POLL_S)
            continue
        stopping.wait(wait)
        wait = min(wait * 2, RETRY_MAX_S)
    return None


def bootstrap(addresses: list[str], identity: Identity, token: str) -> TlsFiles:
    """At start: the node's TLS files, asking for its certificate if it needs one.
    Raises CertificateRefused if the controller refuses it."""
    why = identity.due()
    if why:
        log.info("asking for this node's certificate", node=identity.node, why=why)
        cert = obtain(addresses, identity, token, threading.Event())
        log.info(
            "certificate issued",
            node=identity.node,
            serial=f"{cert.serial_number:x}",
            not_after=cert.not_valid_after_utc.isoformat(),
        )
    return identity.files()


class Renewer:
    """Renews the node's certificate, on a thread, once ``renewal_due`` says so."""

    def __init__(self, addresses: list[str], identity: Identity, token: str):
        self.addresses, self.identity, self.token = addresses, identity, token
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="certificate-renewal", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _period_s(self) -> float:
        cert = self.identity.certificate()
        if cert is None:
            return 1.0
        lifetime = (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
        return max(1.0, min(60.0, lifetime / 20))

    def _run(self) -> None:
        while not self.stopping.wait(self._period_s()):
            why = self.identity.due()
            if not why:
                continue
            try:
                cert = obtain(self.addresses, self.identity, self.token, self.stopping)
            except CertificateRefused as exc:
                log.error("certificate renewal refused", node=self.identity.node, error=str(exc))
                continue
            except Exception as exc:  # a file that cannot be written, say: next time
                log.error("certificate renewal failed", node=self.identity.node, error=str(exc))
                continue
            if cert is not None:
                log.info(
                    "certificate renewed",
                    node=self.identity.node,
                    why=why,
                    serial=f"{cert.serial_number:x}",
                    not_after=cert.not_valid_after_utc.isoformat(),
                )
