"""A TCP proxy between one node's agent and the control plane, which ``keel up`` cuts
to inject ``partition_node``.

Each node gets two listeners on loopback: one forwarding to etcd, one forwarding to
the controller that leads at the moment a connection is made. ``cut()`` closes every
connection through the node's proxy and refuses new ones (closed at once) until
``heal()``: the agent and its ranks keep running, but the node can reach neither etcd
nor any controller, and neither can reach it.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger()

BUFFER_BYTES = 65536


class Listener:
    """Forwards every connection accepted on a free loopback port to ``target()``
    ("host:port", looked up per connection). While ``silent`` is set it forwards
    nothing, either way, and connects nothing upstream, but closes nothing either:
    what its clients see of a peer whose traffic is dropped (the bytes flow again, in
    order, once it is cleared, as TCP's retransmissions would have them)."""

    def __init__(
        self,
        target: Callable[[], str | None],
        cut: threading.Event,
        silent: threading.Event | None = None,
    ):
        self.target = target
        self.cut = cut
        self.silent = silent or threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.live: set[socket.socket] = set()
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            if self.silent.is_set():
                threading.Thread(target=self._held, args=(client,), daemon=True).start()
                continue
            self._open(client)

    def _held(self, client: socket.socket) -> None:
        """A connection accepted while silent: forwarded once the silence ends."""
        while self.silent.is_set() and not self.cut.is_set():
            self.cut.wait(0.2)
        self._open(client)

    def _open(self, client: socket.socket) -> None:
        """Connect ``client`` upstream and forward both ways, on a thread of its own."""
        address = None if self.cut.is_set() else self.target()
        if address is None:
            client.close()
            return
        host, _, port = address.rpartition(":")
        try:
            upstream = socket.create_connection((host, int(port)), timeout=2)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self.lock:
            self.live |= {client, upstream}
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(a, selectors.EVENT_READ, b)
        selector.register(b, selectors.EVENT_READ, a)
        try:
            while not self.cut.is_set():
                if self.silent.is_set():
                    self.cut.wait(0.2)
                    continue
                for key, _ in selector.select(timeout=0.2):
                    data = key.fileobj.recv(BUFFER_BYTES)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            pass
        finally:
            selector.close()
            self._drop(a, b)

    def _drop(self, *sockets: socket.socket) -> None:
        with self.lock:
            for sock in sockets:
                self.live.discard(sock)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def drop_all(self) -> None:
        with self.lock:
            live = list(self.live)
        self._drop(*live)

    def close(self) -> None:
        self.server.close()
        self.drop_all()


class NodeProxy:
    """The proxies of one node: ``etcd_endpoint`` and ``controller`` are what its
    agent is given."""

    def __init__(self, etcd: str, leader: Callable[[], str | None]):
        self._cut = threading.Event()
        self._etcd = Listener(lambda: etcd, self._cut)
        self._controller = Listener(leader, self._cut)
        self.etcd_endpoint = f"127.0.0.1:{self._etcd.port}"
        self.controller = f"127.0.0.1:{self._controller.port}"

    def cut(self) -> None:
        self._cut.set()
        self._etcd.drop_all()
        self._controller.drop_all()

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._cut.set()
        self._etcd.close()
        self._controller.close()
