"""The link's fencing across a restore of etcd from a snapshot: the restored etcd (same
cluster id: the same members restored) numbers its revisions from the snapshot's, so a
new leader's term is below what the agent saw. Without a new epoch it is refused, as
before the epoch existed; with one (``keel restore-epoch``) it is accepted, and the
leaders of before the restore are refused from then on."""

import threading
from types import SimpleNamespace

from agent.link import ControllerLink
from common.epoch import Stamp
from common.leader import Leader

CLUSTER = 0xE7CD


def link() -> ControllerLink:
    return ControllerLink(
        SimpleNamespace(),
        "token",
        None,
        None,
        5.0,
        opening=lambda: [],
        deliver=lambda message: None,
        stopping=threading.Event(),
    )


def test_a_leader_of_a_restored_etcd_is_refused_without_a_new_epoch():
    agent = link()
    agent.leader_changed(Leader("10.0.0.1:7070", "ctl-a", term=900, cluster_id=CLUSTER))
    # The restore wound revisions back to the snapshot's: the next leader's key is
    # created at a lower revision, in the same cluster.
    restored = Leader("10.0.0.2:7070", "ctl-b", term=450, cluster_id=CLUSTER)
    agent.leader_changed(restored)
    assert not agent.current_term(restored.stamp)


def test_a_leader_of_a_later_epoch_is_taken_whatever_its_term_and_older_ones_are_not():
    agent = link()
    agent.leader_changed(Leader("10.0.0.1:7070", "ctl-a", term=900, cluster_id=CLUSTER))
    assert agent.current_term(Stamp(0, 900))
    restored = Leader("10.0.0.2:7070", "ctl-b", term=450, cluster_id=CLUSTER, epoch=1)
    agent.leader_changed(restored)
    assert agent.current_term(restored.stamp)
    assert agent.current_term(Stamp(1, 451))  # a later leader of the new epoch
    assert not agent.current_term(Stamp(0, 900))  # the leader of before the restore
    assert not agent.current_term(Stamp(0, 10**6))
    assert not agent.current_term(Stamp(1, 449))  # superseded within the epoch


def test_an_etcd_rebuilt_from_nothing_starts_the_count_again():
    agent = link()
    agent.leader_changed(Leader("a:1", "ctl-a", term=900, cluster_id=CLUSTER, epoch=3))
    agent.leader_changed(Leader("b:1", "ctl-b", term=5, cluster_id=CLUSTER + 1))
    assert agent.current_term(Stamp(0, 5))
