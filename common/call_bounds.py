"""What a gRPC call may make a Keel daemon hold before, and after, it proves who sends it.

Each bound is enforced at a different place, and says so:

1. **The token, on metadata alone.** An interceptor judges the call from its method and
   metadata (``refusal`` answers one it refuses) with a handler that never asks for
   the request: gRPC then takes no more of the body off the connection than HTTP/2
   flow control lets in ahead of a read (a stream's window, tens of KiB), whatever the
   message's size. A caller without a token costs a daemon that much per call
   (tests/integration/test_call_bounds.py measures it).
2. **The server's receive limit** (``RequestLimits.server_bytes``, the largest of its
   table, given to gRPC as ``grpc.max_receive_message_length``): gRPC refuses a message
   over it from its length prefix, before buffering it, with RESOURCE_EXHAUSTED.
3. **Each method's own limit** (``RequestLimits``, ``BoundedRequests``): checked on the
   bytes of a unary request before they are parsed. gRPC has buffered them by then (up
   to the server's limit), so this bounds what a caller with a token makes a daemon
   parse and keep, not what it makes it receive. A streaming method's messages are
   bounded by the server's limit only; its entry in a table is that limit.
4. **Concurrency**: a server takes at most ``max_rpcs`` calls at once (gRPC refuses the
   next with RESOURCE_EXHAUSTED before reading it) and a connection at most
   ``MAX_STREAMS_PER_CONNECTION`` streams, so that neither the number of calls nor any
   one client multiplies the bounds above past what is planned for.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

KIB, MIB = 1024, 1024 * 1024
# Streams one connection may hold open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS):
# an agent holds one, an operator's client a few; a client past it waits for a slot.
MAX_STREAMS_PER_CONNECTION = 100


@dataclass(frozen=True)
class RequestLimits:
    """The most bytes one request message of each method may have (``per_method``, by
    full method name ``/package.Service/Method``), ``default_bytes`` for the others."""

    per_method: Mapping[str, int]
    default_bytes: int

    def __post_init__(self):
        small = [m for m, n in self.per_method.items() if n <= 0]
        if self.default_bytes <= 0 or small:
            raise ValueError(f"request limits must be positive: {small or 'the default'}")

    def of(self, method: str) -> int:
        return self.per_method.get(method, self.default_bytes)

    @property
    def server_bytes(self) -> int:
        """The server-wide receive limit: the largest any method needs."""
        return max([self.default_bytes, *self.per_method.values()])


def oversize_refusal(method: str, size: int, limit: int) -> str:
    """Why a request of ``size`` bytes to ``method`` is refused, or "" if it fits."""
    if size <= limit:
        return ""
    return (
        f"a {method.rsplit('/', 1)[-1]} request of {size} bytes is over its limit of {limit} bytes"
    )


@dataclass(frozen=True)
class Oversized:
    """What a bounded deserializer yields in place of a request over its limit: the
    handler wrapped around the method refuses it (RESOURCE_EXHAUSTED), unparsed."""

    refusal: str


def refusal(code: grpc.StatusCode, message: str, on_loop: bool = False) -> grpc.RpcMethodHandler:
    """A handler that refuses a call with ``code`` and ``message`` without reading its
    request: request-streaming whatever the method's shape, since gRPC reads a unary
    request whole before it calls a handler, and a streaming one only as it is asked
    for. (Refused before any response, the shape is never seen by the client.)
    ``on_loop``: a coroutine, for a ``grpc.aio`` server, which runs a plain function on
    its thread pool, where a refused stream would hold a thread."""

    def refuse(_requests, context):
        context.abort(code, message)

    async def refuse_on_loop(_requests, context):
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse_on_loop if on_loop else refuse)


def _bounded_deserializer(deserialize, method: str, limit: int):
    def bounded(raw: bytes):
        problem = oversize_refusal(method, len(raw), limit)
        if problem:
            return Oversized(problem)
        return deserialize(raw) if deserialize is not None else raw

    return bounded


def _refusing_oversized(behavior):
    """``behavior``, refusing an ``Oversized`` request (as a coroutine if it is one)."""
    if inspect.iscoroutinefunction(behavior):

        async def checked_on_loop(request, context):
            if isinstance(request, Oversized):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, request.refusal)
            return await behavior(request, context)

        return checked_on_loop

    def checked(request, context):
        if isinstance(request, Oversized):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, request.refusal)
        return behavior(request, context)

    return checked


def bounded(handler: grpc.RpcMethodHandler, method: str, limit: int) -> grpc.RpcMethodHandler:
    """``handler`` with its request refused, unparsed, when over ``limit`` bytes; a
    streaming method's as it is (the server's limit bounds its messages)."""
    if handler.unary_unary is None:
        return handler
    return grpc.unary_unary_rpc_method_handler(
        _refusing_oversized(handler.unary_unary),
        request_deserializer=_bounded_deserializer(handler.request_deserializer, method, limit),
        response_serializer=handler.response_serializer,
    )


class BoundedRequests(grpc.ServerInterceptor):
    """Refuses, unparsed, a unary call's request over its method's limit (``limits``)."""

    def __init__(self, limits: RequestLimits):
        self.limits = limits

    def intercept_service(self, continuation, handler_call_details):
        return self._bounded(continuation(handler_call_details), handler_call_details.method)

    def _bounded(self, handler, method: str):
        if handler is None:
            return None
        return bounded(handler, method, self.limits.of(method))


class AioBoundedRequests(BoundedRequests, grpc.aio.ServerInterceptor):
    """``BoundedRequests`` for a ``grpc.aio`` server."""

    async def intercept_service(self, continuation, handler_call_details):
        return self._bounded(await continuation(handler_call_details), handler_call_details.method)
