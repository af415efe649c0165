"""Following the leader key (common/leader.LeaderWatch) across an etcd restart, and
past a member that stalls: the end of the watch is noticed, and a leader named after
it is seen. (python3-etcd3 0.13's watcher dies of a NameError when etcd's crash ends a
watch: the end is never reported by it, and a watcher relying on it would go on naming
the old leader.)"""

from __future__ import annotations

import threading

from common import keys
from common.etcd import connect
from common.leader import LeaderWatch
from common.records import LeaderRecord
from orchestrator.local.etcd_server import EmbeddedEtcd, memory_backed_dir
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


def test_a_watch_on_a_member_that_stalls_moves_and_sees_the_next_leader():
    """Three members; the member the watch streams from is SIGSTOPped (its kernel still
    holds the connection open, nothing answers). A leader named through another member
    is seen: the watch's keepalive ends the silent stream and it is set up again
    elsewhere. Without the ping, the watch would wait on the frozen member for good."""
    with EmbeddedEtcd(data_parent=memory_backed_dir(), members=3) as etcd:
        watcher = connect(etcd.endpoints, 2.0)
        watch = LeaderWatch(watcher).start()
        try:
            writer = connect(etcd.endpoints, 2.0)
            writer.put(keys.LEADER, LeaderRecord(address="old:1", id="a").to_json())
            wait_for(
                lambda: watch.current and watch.current.address == "old:1",
                30,
                what="the first leader to be seen",
            )
            stalled = etcd.member_of_port(int(watcher.endpoint_in_use.netloc.rpartition(":")[2]))
            etcd.stall(stalled)
            try:
                others = [e for i, e in enumerate(etcd.endpoints) if i != stalled]
                writer = connect(others, 2.0)

                def name_new_leader() -> bool:  # the spared members may be electing
                    try:
                        writer.put(keys.LEADER, LeaderRecord(address="new:2", id="b").to_json())
                    except Exception:
                        return False
                    return True

                wait_for(name_new_leader, 30, 0.2, what="the spared members to take a write")
                wait_for(
                    lambda: watch.current and watch.current.address == "new:2",
                    60,
                    0.2,
                    what="the leader named while the watch's member is stalled to be seen",
                )
            finally:
                etcd.resume(stalled)
        finally:
            watch.stop()
