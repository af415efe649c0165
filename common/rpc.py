"""gRPC channels and servers as every Keel process makes them: mutual TLS when given
certificates (``common.tls``), keepalives on both sides, and explicit message limits
(a server's, per method, with the caps on its calls: ``common.call_bounds``).

Keepalives are what notice a peer that stalls (a SIGSTOPped process, a frozen VM):
its kernel still acknowledges TCP, so a stream to it would hang forever, but it answers
no HTTP/2 ping, and after the keepalive time and ``KEEPALIVE_TIMEOUT_S`` the stream
fails with UNAVAILABLE. That must fit well inside the controller's node-lost grace.

gRPC pings only a connection that has been quiet for the keepalive time. The agents'
streams to the controller (``AGENT_CHANNEL_OPTIONS``, and the controller's server) use
``AGENT_KEEPALIVE_TIME_S``, over the 4 s the controller's pacing asks of 4,000 agents
between step reports, so that a stream that reports is never pinged (pings at 4,000
agents cost the controller a share of a core: docs/BENCHMARKS.md, control_plane).
A stalled agent is noticed by its etcd lease before that, a stalled leader by its
agents through the leader key; the keepalive is for a stream a partition cut.
"""

from __future__ import annotations

from concurrent import futures

import grpc

from common.call_bounds import (
    MAX_STREAMS_PER_CONNECTION,
    AioBoundedRequests,
    BoundedRequests,
    RequestLimits,
)
from common.metrics import AioRpcMetrics, RpcMetrics
from common.tls import TlsFiles, server_credentials

KEEPALIVE_TIME_S = 2.0  # ping a quiet connection this often
AGENT_KEEPALIVE_TIME_S = 6.0  # an agent's stream to the controller (see above)
KEEPALIVE_TIMEOUT_S = 2.0  # and give up on it this long after a ping goes unanswered
# Replies hold a job's events and a hang's stacks (each bounded, see the controller's
# job health); nothing legitimate comes near this. A server's receive limit is its own,
# the largest of its methods' (``server_options``, ``common.call_bounds``).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

MESSAGE_LIMITS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _channel_options(keepalive_s: float) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        *MESSAGE_LIMITS,
    ]


CHANNEL_OPTIONS = _channel_options(KEEPALIVE_TIME_S)
AGENT_CHANNEL_OPTIONS = _channel_options(AGENT_KEEPALIVE_TIME_S)
SERVER_OPTIONS = [
    # No bandwidth-delay probing: it pings a peer on the data it sends, to size flow
    # control for bulk transfers. Agents' messages are small and many (thousands of
    # streams), and the probes cost a controller a share of its CPU at thousands of
    # agents (docs/BENCHMARKS.md, control_plane); the default window still carries an
    # operator's largest reply at LAN speed.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.keepalive_time_ms", int(AGENT_KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    # Operators' clients ping every KEEPALIVE_TIME_S: accept that, however idle.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_TIME_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def channel(
    address: str, files: TlsFiles | None, options: list[tuple[str, int]] = CHANNEL_OPTIONS
) -> grpc.Channel:
    """A channel to ``address`` presenting ``files.cert`` and trusting only
    ``files.ca`` (plaintext if ``files`` is None), with keepalives (an operator's:
    ``CHANNEL_OPTIONS``; an agent's stream to the controller: ``AGENT_CHANNEL_OPTIONS``)."""
    if files is None:
        return grpc.insecure_channel(address, options=options)
    ca, cert, key = files.pems()
    return grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert),
        options=options,
    )


def server_options(limits: RequestLimits) -> list[tuple[str, int]]:
    """``SERVER_OPTIONS`` with the receive limit of ``limits`` (its largest method's:
    ``common.call_bounds``) and the cap on one connection's streams."""
    return [
        *SERVER_OPTIONS,
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", limits.server_bytes),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]


def server(max_workers: int, limits: RequestLimits, max_rpcs: int, interceptors=()) -> grpc.Server:
    """A server with keepalives, whose RPCs are counted and timed (``common.metrics``;
    outermost, so that calls ``interceptors`` refuse count too), run after
    ``interceptors`` (a token check, on metadata alone) with each unary request held
    to its method's size in ``limits``, at most ``max_rpcs`` at once (gRPC answers
    one more RESOURCE_EXHAUSTED): ``common.call_bounds``."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[RpcMetrics(), *interceptors, BoundedRequests(limits)],
        options=server_options(limits),
        maximum_concurrent_rpcs=max_rpcs,
    )


def aio_server(
    max_workers: int, limits: RequestLimits, max_rpcs: int, interceptors=()
) -> grpc.aio.Server:
    """``server`` on ``grpc.aio``, made on the event loop that will run it: coroutine
    handlers run on the loop (a stream costs no thread), plain ones on a pool of
    ``max_workers`` threads."""
    return grpc.aio.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[AioRpcMetrics(), *interceptors, AioBoundedRequests(limits)],
        options=server_options(limits),
        maximum_concurrent_rpcs=max_rpcs,
    )


def add_port(server_: grpc.Server, listen: str, files: TlsFiles | None) -> int:
    """Bind ``listen`` with mutual TLS (plaintext if ``files`` is None); the port."""
    if files is None:
        return server_.add_insecure_port(listen)
    return server_.add_secure_port(listen, server_credentials(files))
