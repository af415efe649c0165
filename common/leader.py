"""Following the leader key: who leads now, learnt within a moment of a change.

A ``LeaderWatch`` follows ``/keel/controller/leader`` (``common.watch``: read, then
watched from the revision read, read again whenever the watch breaks). ``current`` is
the leader as last seen, and ``on_change`` is called with every new value.

A leader's ``term`` is its key's create revision: it only grows, within one etcd
cluster (``cluster_id``; a cluster rebuilt from nothing numbers its revisions anew) and
one ``epoch`` (the one its record names: a restore from a snapshot winds revisions back
and advances the epoch, ``common.epoch``). ``stamp`` is the pair agents compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
from etcd3 import events

from common import keys
from common.epoch import Stamp
from common.etcd import EtcdClient
from common.records import LeaderRecord, RecordError
from common.watch import Watch

log = structlog.get_logger()


STANDBY_REFUSAL = "standby controller; the leader is at "  # then its address, or "unknown"


def standby_refusal(leader_address: str | None) -> str:
    """What a standby answers a call that only the leader serves: it names the leader,
    so that the caller goes there at once (``named_leader``)."""
    return STANDBY_REFUSAL + (leader_address or "unknown")


def named_leader(details: str | None) -> str | None:
    """The leader's address a standby's refusal names; None if ``details`` is no such
    refusal or names none."""
    if not details or not details.startswith(STANDBY_REFUSAL):
        return None
    address = details[len(STANDBY_REFUSAL) :].strip()
    return address if address and address != "unknown" and " " not in address else None


@dataclass(frozen=True)
class Leader:
    address: str
    id: str
    term: int
    cluster_id: int
    epoch: int = 0

    @property
    def stamp(self) -> Stamp:
        return Stamp(self.epoch, self.term)


def _log_unreadable(error: RecordError) -> None:
    log.warning("ignoring a leader key that is not a controller's record", error=str(error))


def parse_leader(
    raw: bytes,
    create_revision: int,
    cluster_id: int,
    set_aside: Callable[[RecordError], None] = _log_unreadable,
) -> Leader | None:
    """The leader a key value names; None if it names none we can read (``set_aside``
    is told why)."""
    try:
        record = LeaderRecord.from_json(keys.LEADER, raw)
    except RecordError as error:
        set_aside(error)
        return None
    return Leader(record.address, record.id, create_revision, cluster_id, record.epoch)


class LeaderWatch:
    """The leader key, followed (``common.watch.Watch``)."""

    def __init__(
        self,
        etcd: EtcdClient,
        on_change: Callable[[Leader | None], None] = lambda _: None,
        set_aside: Callable[[RecordError], None] = _log_unreadable,
    ):
        """``on_change``: told of each new leader; ``set_aside``: of each value of the
        key that is no controller's record."""
        self.etcd = etcd
        self.on_change = on_change
        self.set_aside = set_aside
        self.current: Leader | None = None
        self._known = False
        self._cluster = 0
        self._watch = Watch(
            etcd,
            keys.LEADER,
            prefix=False,
            on_reset=self._reset,
            on_events=self._events,
            name="the leader key",
        )

    def start(self) -> LeaderWatch:
        self._watch.start()
        return self

    def stop(self) -> None:
        self._watch.stop()

    def _set(self, leader: Leader | None) -> None:
        if self._known and leader == self.current:
            return
        self.current, self._known = leader, True
        self.on_change(leader)

    def _reset(self, kvs: list, cluster: int) -> None:
        self._cluster = cluster
        self._set(
            parse_leader(kvs[0].value, kvs[0].create_revision, cluster, self.set_aside)
            if kvs
            else None
        )

    def _events(self, changes: list) -> None:
        for event in changes:
            if isinstance(event, events.DeleteEvent):
                self._set(None)
            else:
                self._set(
                    parse_leader(event.value, event.create_revision, self._cluster, self.set_aside)
                )
