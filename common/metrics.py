"""What every daemon exports to Prometheus alike: its etcd calls and the RPCs it
serves, and the ``/metrics`` endpoint itself (docs/metrics.md names every series).

Labels stay bounded: an etcd call is labelled by its method (``Range``, ``Txn``, ...),
an RPC by its method and status code."""

from __future__ import annotations

import contextlib
import inspect
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from common.tls import TlsFiles

ETCD_SECONDS = Histogram(
    "keel_etcd_request_seconds",
    "One etcd call, seconds",
    ["op"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
ETCD_ERRORS = Counter("keel_etcd_request_errors", "etcd calls that failed", ["op"])
ETCD_UP = Gauge("keel_etcd_up", "1 if the latest etcd call succeeded")
RPC_HANDLED = Counter("keel_grpc_server_handled", "RPCs served, by status code", ["method", "code"])
RPC_SECONDS = Histogram(
    "keel_grpc_server_handling_seconds",
    "Time to serve one RPC (a stream: its whole life), seconds",
    ["method"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300, 3600),
)


def serve(listen: str, tls: TlsFiles | None = None):
    """Serve ``/metrics`` on ``listen`` ("host:port"; port 0 picks a free one) from a
    daemon thread, over HTTPS with the daemon's certificate when ``tls`` is given
    (clients then need a certificate of the same CA). Returns the server: its
    ``server_port``, and ``shutdown()`` to stop it."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"metrics address {listen!r}: write it as host:port (port 0 picks a free one)"
        )
    kwargs = {}
    if tls is not None:
        kwargs = dict(
            certfile=str(tls.cert),
            keyfile=str(tls.key),
            client_cafile=str(tls.ca),
            client_auth_required=True,
        )
    server, _ = start_http_server(int(port), addr=host.strip("[]"), **kwargs)
    return server


def _method(full: str) -> str:
    """``/keel.v1.Controller/GetJob`` -> ``GetJob``."""
    return full.rpartition("/")[2] or full


class EtcdCallMetrics(grpc.UnaryUnaryClientInterceptor):
    """Times every unary etcd call (streams, the watches and lease keep-alives, are
    long-lived and not timed) and counts its failures."""

    def intercept_unary_unary(self, continuation, client_call_details, request):
        op = _method(client_call_details.method)
        start = time.monotonic()
        outcome = continuation(client_call_details, request)
        # The outcome is a future that has completed (a blocking call) or carries the
        # error; code() waits for it.
        failed = outcome.code() is not grpc.StatusCode.OK
        ETCD_SECONDS.labels(op=op).observe(time.monotonic() - start)
        errors = ETCD_ERRORS.labels(op=op)  # at 0 from an op's first call
        if failed:
            errors.inc()
        ETCD_UP.set(
            0
            if failed
            and outcome.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            else 1
        )
        return outcome


class RpcMetrics(grpc.ServerInterceptor):
    """Counts every RPC a server handles by method and status code, and times it."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = _method(handler_call_details.method)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            # (Its one reply is returned as a unary call's: the stream is its argument.)
            return grpc.stream_unary_rpc_method_handler(
                _unary(handler.stream_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class AioRpcMetrics(grpc.aio.ServerInterceptor):
    """``RpcMetrics`` for a ``grpc.aio`` server, whose handlers are coroutines (a
    stream on the event loop) or plain functions (run on its thread pool)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = _method(handler_call_details.method)
        if handler.unary_unary and not inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                _pooled_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream and inspect.iscoroutinefunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                _async_streaming(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class _KeepsCode:
    """The context of a handler an aio server runs on its thread pool, which keeps no
    status code: this one remembers the code the handler set or aborted with."""

    def __init__(self, context):
        self._context, self._code = context, None

    def abort(self, code, details="", trailing_metadata=()):
        self._code = code
        self._context.abort(code, details, trailing_metadata)

    def set_code(self, code):
        self._code = code
        self._context.set_code(code)

    def code(self):
        return self._code

    def __getattr__(self, name):
        return getattr(self._context, name)


def _pooled_unary(behavior, method: str):
    unary = _unary(behavior, method)

    def handle(request, context):
        return unary(request, _KeepsCode(context))

    return handle


def _record(method: str, context, start: float, error: BaseException | None) -> None:
    code = context.code()
    if code is None:
        code = grpc.StatusCode.UNKNOWN if error is not None else grpc.StatusCode.OK
    RPC_HANDLED.labels(method=method, code=code.name).inc()
    RPC_SECONDS.labels(method=method).observe(time.monotonic() - start)


@contextlib.contextmanager
def _counted(method: str, context):
    """Counts and times the RPC the block serves."""
    start, error = time.monotonic(), None
    try:
        yield
    except BaseException as exc:  # context.abort raises; it is re-raised
        error = exc
        raise
    finally:
        _record(method, context, start, error)


def _unary(behavior, method: str):
    def handle(request, context):
        with _counted(method, context):
            return behavior(request, context)

    return handle


def _async_streaming(behavior, method: str):
    async def handle(request_iterator, context):
        with _counted(method, context):
            return await behavior(request_iterator, context)

    return handle


def _streaming(behavior, method: str):
    def handle(request, context):
        with _counted(method, context):
            yield from behavior(request, context)

    return handle
