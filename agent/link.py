"""The agent's link to the leading controller: find it in etcd, hold one ``Connect``
stream to it (a Hello first, then the replays, then whatever the agent sends), hand
what it says to the agent's main loop, and reconnect with back-off when the stream
ends.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable

import grpc
import structlog

from common import keys
from common.etcd import EtcdClient
from common.tls import TlsFiles, call_metadata, channel
from protos import keel_pb2, keel_pb2_grpc

log = structlog.get_logger()

BACKOFF_FIRST_S = 0.1
HEALTHY_STREAM_S = 10.0   # a stream that lasted this long resets the back-off


class ControllerLink:
    def __init__(self, etcd: EtcdClient, token: str, tls: TlsFiles | None,
                 controller: str | None, reconnect_max_s: float,
                 opening: Callable[[], list[keel_pb2.AgentMessage]],
                 deliver: Callable[[keel_pb2.ControllerMessage], None],
                 stopping: threading.Event):
        """``opening()`` gives the messages that open each stream (the Hello, then the
        replays); ``deliver`` takes every controller message but the Welcome;
        ``controller``: a fixed host:port, or None to follow the leader in etcd."""
        self.etcd = etcd
        self.token = token
        self.tls = tls
        self.controller = controller
        self.reconnect_max_s = reconnect_max_s
        self.opening = opening
        self.deliver = deliver
        self.stopping = stopping
        self.outbox: queue.Queue = queue.Queue()
        self._call = None     # the Connect call in progress

    def send(self, message: keel_pb2.AgentMessage) -> None:
        """Queue ``message`` for the controller (sent on the current stream, or the
        next one)."""
        self.outbox.put(message)

    def reconnect(self) -> None:
        """End the stream in progress; the next one opens with a fresh Hello."""
        call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        self.outbox.put(None)

    def run(self) -> None:
        """Keep a stream to the leader until ``stopping`` is set."""
        backoff = BACKOFF_FIRST_S
        while not self.stopping.is_set():
            try:
                address = self._address()
            except Exception as exc:
                address = None
                log.warning("cannot read the controller address from etcd", error=str(exc))
            if address:
                started = time.monotonic()
                try:
                    self._stream(address)
                except Exception as exc:  # e.g. TLS files unreadable: retry, never die
                    log.error("cannot connect to the controller", address=address,
                              error=f"{type(exc).__name__}: {exc}")
                if time.monotonic() - started > HEALTHY_STREAM_S:
                    backoff = BACKOFF_FIRST_S
            if self.stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self.reconnect_max_s)

    def _address(self) -> str | None:
        if self.controller:
            return self.controller
        raw, _ = self.etcd.get(keys.LEADER)
        return json.loads(raw)["address"] if raw else None

    def _requests(self, closed: threading.Event):
        yield from self.opening()
        while not closed.is_set():
            try:
                message = self.outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if message is None:
                return
            yield message

    def _stream(self, address: str) -> None:
        closed = threading.Event()
        with channel(address, self.tls) as link:
            stub = keel_pb2_grpc.ControllerStub(link)
            self._call = stub.Connect(self._requests(closed),
                                      metadata=call_metadata(self.token))
            try:
                for message in self._call:
                    if message.WhichOneof("kind") == "welcome":
                        log.info("connected to controller", address=address,
                                 controller_id=message.welcome.controller_id)
                    else:
                        self.deliver(message)
            except grpc.RpcError as exc:
                if not self.stopping.is_set():
                    log.warning("controller stream ended", address=address,
                                code=str(exc.code()), details=exc.details())
            finally:
                self._call = None
                closed.set()
