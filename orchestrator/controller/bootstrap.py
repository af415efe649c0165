"""TLS bootstrapping: the ``Bootstrap`` service, on the controller's own
``--bootstrap-port``, where an agent that holds only the CA certificate and the join
token asks for its node's certificate (``policy.certificates`` decides; the CA key
signs; the node's ``CertificateRecord`` in etcd keeps what was decided).

The port serves TLS with the controller's certificate and asks for no client
certificate (an agent bootstrapping has none): the join token, checked on the call's
metadata before its body is read, is the whole check, and a request is at most
``REQUEST_BYTES``. Only the leader signs (a standby answers UNAVAILABLE, and the agent
asks the next address), one request at a time, each record written only if it did not
change since it was read: two controllers, or two requests for one node, never both
sign.
"""

from __future__ import annotations

import threading
import time

import grpc
import structlog
from cryptography.hazmat.primitives import serialization

from common import rpc
from common.call_bounds import KIB, RequestLimits
from common.node_identity import key_sha256
from common.records import RecordError
from orchestrator.controller import metrics
from orchestrator.controller.state import ControllerState
from orchestrator.controller.store import Deposed
from orchestrator.policy import certificates
from orchestrator.policy.certificates import Answer
from orchestrator.security.auth import TokenInterceptor
from orchestrator.security.certs import NodeSigner, RequestError
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

# A certificate request of any key we sign is under 2 KiB; a node name is short.
REQUEST_BYTES = 16 * KIB
LIMITS = RequestLimits(per_method={}, default_bytes=REQUEST_BYTES)
WORKERS = 4  # requests are signed one at a time; the others wait on the lock
MAX_CALLS = 32  # at once; one more is refused RESOURCE_EXHAUSTED before it is read


class BootstrapService(keel_pb2_grpc.BootstrapServicer):
    def __init__(self, state: ControllerState, signer: NodeSigner):
        self.state = state
        self.signer = signer
        self.lock = threading.Lock()

    def RequestCertificate(self, request, context):
        state = self.state
        try:
            csr = self.signer.check(request.node, request.csr_pem)
        except RequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not state.is_leader:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "this controller does not lead; ask the leader's --bootstrap-port",
            )
        node, key = request.node, key_sha256(csr.public_key())
        with self.lock:
            try:
                stored = state.store.certificate(node)
            except RecordError as exc:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"node {node}'s certificate record does not parse ({exc.problem}); "
                    f"`keel certs revoke {node}` then `keel certs approve {node}` write it anew",
                )
            except Exception as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
            decision = certificates.on_request(
                node, stored.value, key, state.config.approve_agents, time.time()
            )
            if decision.answer is Answer.REFUSE:
                metrics.CERTIFICATE_REQUESTS.labels(answer="refused").inc()
                log.warning("certificate request refused", node=node, reason=decision.message)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, decision.message)
            record, pem = decision.record, b""
            if decision.answer is Answer.ISSUE:
                cert = self.signer.sign(node, csr, state.config.agent_certificate_lifetime_s)
                record = certificates.issued(
                    record, f"{cert.serial_number:x}", cert.not_valid_after_utc.timestamp()
                )
                pem = cert.public_bytes(serialization.Encoding.PEM)
            if record is not None:
                self._store(node, record, stored.mod_revision, context)
        if decision.answer is Answer.PENDING:
            metrics.CERTIFICATE_REQUESTS.labels(answer="pending").inc()
            if record is not None:
                log.info("certificate request waits for approval", node=node, key_sha256=key)
            return keel_pb2.CertificateReply(pending=True, message=decision.message)
        metrics.CERTIFICATE_REQUESTS.labels(answer="issued").inc()
        renewal = stored.value is not None and stored.value.issued > 0
        log.info(
            "certificate renewed" if renewal else "certificate issued",
            node=node,
            serial=record.serial,
            not_after_unix=record.not_after_unix,
            key_sha256=key,
        )
        return keel_pb2.CertificateReply(
            certificate_pem=pem,
            message=f"node {node}'s certificate, serial {record.serial}",
        )

    def _store(self, node: str, record, seen_revision: int, context) -> None:
        try:
            stored = self.state.store.put_certificate(node, record, seen_revision)
        except Deposed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this controller no longer leads")
        except Exception as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        if not stored:  # an operator's call came between the read and the write
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"node {node}'s certificate record changed meanwhile; ask again",
            )


def serve(
    state: ControllerState, signer: NodeSigner, listen: str, tokens
) -> tuple[grpc.Server, int]:
    """The bootstrap server, started on ``listen`` (server TLS with the controller's
    certificate, no client certificate asked): (the server, its port)."""
    server = rpc.server(WORKERS, LIMITS, MAX_CALLS, interceptors=[TokenInterceptor(tokens)])
    keel_pb2_grpc.add_BootstrapServicer_to_server(BootstrapService(state, signer), server)
    _, cert, key = state.config.tls.pems()
    port = server.add_secure_port(listen, grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    return server, port
