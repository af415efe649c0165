"""A key, or every key under a prefix, followed in etcd: read whole once, then watched
from the revision after that read, so that no change falls between the two; when the
watch breaks (etcd restarts, fails over, is out of reach, or compacted the revision)
it is read whole and watched again. The cost is one read per break, not one per use.

``on_reset(kvs, cluster_id)`` gets everything the read found; ``on_events(events)``
each batch of changes since (``etcd3.events.PutEvent`` and ``DeleteEvent``), in order,
on the watch's own thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import grpc
import structlog

from common.etcd import EtcdClient, prefix_end, read_prefix

log = structlog.get_logger()

RETRY_S = 0.5
POLL_S = 0.2  # how often the watch thread looks whether it was asked to stop


class Watch:
    def __init__(
        self,
        etcd: EtcdClient,
        key: str,
        *,
        prefix: bool,
        on_reset: Callable[[list, int], None],
        on_events: Callable[[list], None],
        name: str,
    ):
        """``key``: the key followed, or with ``prefix`` the prefix of those followed;
        ``name``: what it follows, for its thread and log lines."""
        self.etcd = etcd
        self.key, self.prefix, self.name = key, prefix, name
        self.on_reset, self.on_events = on_reset, on_events
        self.failing = False  # the last read or watch failed (until one works)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def _read(self) -> tuple[list, int, int]:
        if self.prefix:
            return read_prefix(self.etcd, self.key)
        response = self.etcd.get_response(self.key)
        return list(response.kvs), response.header.revision, response.header.cluster_id

    def _run(self) -> None:
        while not self._stopping.is_set():
            watch_id = None
            try:
                kvs, revision, cluster = self._read()
                self.on_reset(kvs, cluster)
                arrived: queue.Queue = queue.Queue()
                extra = {"range_end": prefix_end(self.key.encode())} if self.prefix else {}
                watch_id = self.etcd.add_watch_callback(
                    self.key, arrived.put, start_revision=revision + 1, **extra
                )
                if self.failing:
                    log.info("watching again", what=self.name)
                    self.failing = False
                while not self._stopping.is_set():
                    try:
                        item = arrived.get(timeout=POLL_S)
                    except queue.Empty:
                        continue
                    if item is None or isinstance(item, Exception):
                        if isinstance(item, grpc.RpcError):  # its member went away
                            self.etcd.leave_member()
                        raise ConnectionError(f"the watch ended: {item}")
                    if item.events:
                        self.on_events(item.events)
            except Exception as exc:  # etcd out of reach, restarting, failing over
                if not self.failing:
                    log.warning("cannot watch; retrying", what=self.name, error=str(exc))
                    self.failing = True
                self._stopping.wait(RETRY_S)
            finally:
                if watch_id is not None:
                    try:
                        self.etcd.cancel_watch(watch_id)
                    except Exception:
                        pass  # the watch died with its stream
