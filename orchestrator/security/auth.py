"""Token check and roles on every controller RPC.

Clients send ``authorization: Bearer <token>`` metadata. There are three roles, one
token each: ``join`` (agents; only ``Connect``), ``operator`` (every call an operator
makes, mutating ones included) and ``reader`` (read-only calls). A controller given a
single token treats it as every role's.

A missing or wrong token is answered UNAUTHENTICATED, and a right token of the wrong
role PERMISSION_DENIED, from the call's metadata, before its request is read
(``common.call_bounds.refusal``): neither changes anything, and neither makes the
controller buffer the message a caller sends with it. A
method missing from ``METHOD_ROLES`` is refused to every token: a new RPC is closed
until someone decides who may call it.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass, field

import grpc
from cryptography import x509

from common.call_bounds import refusal
from common.node_identity import bound_node, key_sha256

SERVICE = "/keel.v1.Controller/"
BOOTSTRAP_SERVICE = "/keel.v1.Bootstrap/"


class Role(enum.Enum):
    JOIN = "join"
    OPERATOR = "operator"
    READER = "reader"


# Which roles may call each controller method. Mutating calls are the operator's only.
METHOD_ROLES: dict[str, frozenset[Role]] = {
    SERVICE + "Connect": frozenset({Role.JOIN}),
    SERVICE + "SubmitJob": frozenset({Role.OPERATOR}),
    SERVICE + "GetJob": frozenset({Role.READER, Role.OPERATOR}),
    SERVICE + "ListJobs": frozenset({Role.READER, Role.OPERATOR}),
    SERVICE + "ListNodes": frozenset({Role.READER, Role.OPERATOR}),
    SERVICE + "ReadLog": frozenset({Role.READER, Role.OPERATOR}),
    SERVICE + "CordonNode": frozenset({Role.OPERATOR}),
    SERVICE + "UncordonNode": frozenset({Role.OPERATOR}),
    SERVICE + "DrainNode": frozenset({Role.OPERATOR}),
    SERVICE + "ReplaceNode": frozenset({Role.OPERATOR}),
    SERVICE + "CheckpointJob": frozenset({Role.OPERATOR}),
    SERVICE + "StopJob": frozenset({Role.OPERATOR}),
    SERVICE + "DeleteJob": frozenset({Role.OPERATOR}),
    SERVICE + "ApproveCertificate": frozenset({Role.OPERATOR}),
    SERVICE + "RevokeCertificate": frozenset({Role.OPERATOR}),
    SERVICE + "ListCertificates": frozenset({Role.READER, Role.OPERATOR}),
    # TLS bootstrapping (``orchestrator.controller.bootstrap``), on its own port.
    BOOTSTRAP_SERVICE + "RequestCertificate": frozenset({Role.JOIN}),
}


@dataclass(frozen=True)
class Tokens:
    """The controller's token per role."""

    join: str = field(repr=False)
    operator: str = field(repr=False)
    reader: str = field(repr=False)

    def __post_init__(self):
        for role in Role:
            if not getattr(self, role.value):
                raise ValueError(f"the {role.value} token is empty")
        distinct = {self.join, self.operator, self.reader}
        if len(distinct) == 2:
            # Either one token for everything, or three: two equal ones would silently
            # give one role the other's rights.
            raise ValueError(
                "the join, operator and reader tokens must all differ "
                "(or give one token for every role)"
            )

    @classmethod
    def single(cls, token: str) -> Tokens:
        """One token valid for every role (a controller given only ``--token-file``)."""
        if not token:
            raise ValueError("the controller needs a non-empty token (--token-file or KEEL_TOKEN)")
        return cls(token, token, token)

    def roles_of(self, token: str) -> frozenset[Role]:
        """The roles ``token`` holds; empty if it is none of ours."""
        sent = token.encode()
        # Compare against every token, always, so the time taken says nothing.
        matches = [
            (role, hmac.compare_digest(sent, getattr(self, role.value).encode())) for role in Role
        ]
        return frozenset(role for role, match in matches if match)


@dataclass(frozen=True)
class Denial:
    code: grpc.StatusCode
    message: str


def _names(roles) -> str:
    order = [r for r in Role if r in roles]
    return " or ".join(r.value for r in order)


def authorize(method: str, authorization: str, tokens: Tokens) -> Denial | None:
    """Whether a call of ``method`` (``/keel.v1.Controller/Name``) carrying the
    ``authorization`` metadata value may run: None if so, else why not."""
    if not authorization:
        return Denial(
            grpc.StatusCode.UNAUTHENTICATED, "missing token: send 'authorization: Bearer <token>'"
        )
    scheme, _, token = authorization.partition(" ")
    held = tokens.roles_of(token) if scheme == "Bearer" and token else frozenset()
    if not held:
        return Denial(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
    allowed = METHOD_ROLES.get(method, frozenset())
    name = method.rsplit("/", 1)[-1]
    if not allowed:
        return Denial(
            grpc.StatusCode.PERMISSION_DENIED, f"{name} is in no role's table; no token may call it"
        )
    if held & allowed:
        return None
    return Denial(
        grpc.StatusCode.PERMISSION_DENIED,
        f"the {_names(held)} token cannot call {name}; use the {_names(allowed)} token",
    )


class TokenInterceptor(grpc.ServerInterceptor):
    on_loop = False

    def __init__(self, tokens: Tokens | str):
        """``tokens``: the per-role tokens, or one token for every role."""
        self.tokens = tokens if isinstance(tokens, Tokens) else Tokens.single(tokens)

    def intercept_service(self, continuation, handler_call_details):
        return self._checked(continuation(handler_call_details), handler_call_details)

    def _checked(self, handler, handler_call_details):
        """``handler``, or one that refuses the call if its token may not make it."""
        if handler is None:
            return None
        sent = dict(handler_call_details.invocation_metadata).get("authorization", "")
        denial = authorize(handler_call_details.method, sent, self.tokens)
        if denial is None:
            return handler
        return refusal(denial.code, denial.message, self.on_loop)


class AioTokenInterceptor(TokenInterceptor, grpc.aio.ServerInterceptor):
    """``TokenInterceptor`` for a ``grpc.aio`` server."""

    on_loop = True

    async def intercept_service(self, continuation, handler_call_details):
        return self._checked(await continuation(handler_call_details), handler_call_details)


@dataclass(frozen=True)
class Presented:
    """The client certificate of a mutual-TLS call: the node it binds (None: none, the
    shared agent certificate; ``common.node_identity.bound_node``) and its key's
    fingerprint."""

    bound: str | None
    key_sha256: str


def presented_certificate(auth_context: dict) -> Presented | None:
    """The certificate the caller presented, from gRPC's auth context; None over
    plaintext (the token is then the whole check)."""
    pems = auth_context.get("x509_pem_cert")
    if not pems:
        return None
    cert = x509.load_pem_x509_certificate(pems[0])
    return Presented(bound_node(cert), key_sha256(cert.public_key()))
