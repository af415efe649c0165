"""Following the leader key: who leads now, learnt within a moment of a change.

A ``LeaderWatch`` reads ``/keel/controller/leader`` and then watches it from the
revision it read, so no change falls between the two; when the watch breaks (etcd
restarts, fails over, or is out of reach) it reads and watches again. ``current`` is
the leader as last seen, and ``on_change`` is called with every new value.

A leader's ``term`` is its key's create revision: it only grows, within one etcd
cluster (``cluster_id``; a cluster rebuilt from nothing numbers its revisions anew).
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from etcd3 import events

from common import keys
from common.etcd import EtcdClient

log = structlog.get_logger()

RETRY_S = 0.5
POLL_S = 0.2     # how often the watch thread looks whether it was asked to stop


@dataclass(frozen=True)
class Leader:
    address: str
    id: str
    term: int
    cluster_id: int


def parse(raw: bytes, create_revision: int, cluster_id: int) -> Leader | None:
    """The leader a key value names; None if it names none we can read."""
    try:
        value = json.loads(raw)
        return Leader(str(value["address"]), str(value["id"]), create_revision, cluster_id)
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a leader key that is not a controller's record", raw=raw[:200])
        return None


class LeaderWatch:
    def __init__(self, etcd: EtcdClient, on_change: Callable[[Leader | None], None] = lambda _: None):
        self.etcd = etcd
        self.on_change = on_change
        self.current: Leader | None = None
        self._known = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-watch", daemon=True)

    def start(self) -> LeaderWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def _set(self, leader: Leader | None) -> None:
        if self._known and leader == self.current:
            return
        self.current, self._known = leader, True
        self.on_change(leader)

    def _run(self) -> None:
        failing = False
        while not self._stopping.is_set():
            watch_id = None
            try:
                response = self.etcd.get_response(keys.LEADER)
                cluster = response.header.cluster_id
                self._set(parse(response.kvs[0].value, response.kvs[0].create_revision, cluster)
                          if response.kvs else None)
                arrived: queue.Queue = queue.Queue()
                watch_id = self.etcd.add_watch_callback(
                    keys.LEADER, arrived.put, start_revision=response.header.revision + 1)
                if failing:
                    log.info("watching the leader key again")
                    failing = False
                while not self._stopping.is_set():
                    try:
                        item = arrived.get(timeout=POLL_S)
                    except queue.Empty:
                        continue
                    if item is None or isinstance(item, Exception):
                        raise ConnectionError(f"the watch ended: {item}")
                    for event in item.events:
                        if isinstance(event, events.DeleteEvent):
                            self._set(None)
                        else:
                            self._set(parse(event.value, event.create_revision, cluster))
            except Exception as exc:  # etcd out of reach, restarting, failing over
                if not failing:
                    log.warning("cannot watch the leader key; retrying", error=str(exc))
                    failing = True
                self._stopping.wait(RETRY_S)
            finally:
                if watch_id is not None:
                    try:
                        self.etcd.cancel_watch(watch_id)
                    except Exception:
                        pass  # the watch died with its stream
