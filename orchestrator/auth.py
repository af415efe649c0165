"""Token check on every controller RPC.

Clients send ``authorization: Bearer <token>`` metadata. A wrong or missing token is
answered UNAUTHENTICATED before any handler runs, so it changes nothing.
"""

from __future__ import annotations

import hmac

import grpc


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("the controller needs a non-empty token "
                             "(--token-file or KEEL_TOKEN)")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        sent = dict(handler_call_details.invocation_metadata).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), self._expected):
            reason = ("missing token: send 'authorization: Bearer <token>'" if not sent
                      else "wrong token")
            return _deny(handler, reason)
        return handler


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates a client call."""
    return (("authorization", f"Bearer {token}"),)
