"""Following the leader key across an etcd restart (common/leader.LeaderWatch): the
watch that etcd's crash ends is noticed, and a leader named after the restart is seen.
(python3-etcd3 0.13's watcher dies of a NameError on that path: the end of the watch
is never reported by it, and a watcher relying on it would go on naming the old
leader.)"""

from __future__ import annotations

import threading

from common import keys
from common.etcd import connect
from common.leader import LeaderWatch
from common.records import LeaderRecord
from tests.conftest import wait_for


def test_a_leader_named_after_an_etcd_restart_is_seen(etcd):
    client = connect([etcd.endpoint], 2.0)
    crashed = []
    excepthook = threading.excepthook
    threading.excepthook = lambda args: crashed.append(args.exc_value)
    watch = LeaderWatch(client).start()
    try:
        client.put(keys.LEADER, LeaderRecord(address="old:1", id="a").to_json())
        wait_for(
            lambda: watch.current and watch.current.address == "old:1",
            30,
            what="the first leader to be seen",
        )
        etcd.restart()

        def name_new_leader() -> bool:  # the client may take a moment to retry etcd
            try:
                client.put(keys.LEADER, LeaderRecord(address="new:2", id="b").to_json())
            except Exception:
                return False
            return True

        wait_for(name_new_leader, 30, 0.2, what="etcd to take a write again")
        wait_for(
            lambda: watch.current and watch.current.address == "new:2",
            30,
            what="the leader named after the restart to be seen",
        )
        assert crashed == [], f"a watcher thread died: {crashed!r}"
    finally:
        watch.stop()
        threading.excepthook = excepthook
