"""etcd restarts and lost leases, with a real etcd and real controller/agent processes."""

from __future__ import annotations

import etcd3
import pytest

from common.etcd import EtcdClient, EtcdCredentials, connect
from orchestrator.controller.store import Store
from tests.conftest import enable_etcd_auth, etcdctl, wait_for


def _succeeds(call):
    try:
        call()
        return True
    except Exception:
        return False


def test_a_client_with_a_user_works_again_after_etcd_restarts(etcd):
    enable_etcd_auth(etcdctl(etcd.endpoint))
    ours = EtcdClient([etcd.endpoint], 2.0, EtcdCredentials(user="keel", password="keel-pw"))
    stock = etcd3.client(*etcd.endpoint.split(":"), timeout=2.0)  # as shipped; no user
    ours.put("/keel/probe", "1")

    etcd.proc.kill()
    etcd.proc.wait()
    for client in (ours, stock):
        with pytest.raises(etcd3.exceptions.ConnectionFailedError):
            client.get("/keel/probe")
    etcd.restart(down_s=0.0)
    # Ours logs in again (etcd forgot its token) and reconnects once etcd is back.
    wait_for(
        lambda: _succeeds(lambda: ours.put("/keel/probe", "2")),
        20,
        0.2,
        what="our client to reach the restarted etcd",
    )
    assert ours.get("/keel/probe")[0] == b"2"
    # The stock client refuses its endpoint for five minutes after one error: what
    # ours is there for.
    with pytest.raises(ValueError, match="failed node"):
        stock.get("/keel/probe")


def test_an_agent_whose_lease_vanished_registers_again(cluster):
    cluster.controller()
    cluster.agent("node-a", ttl="3")
    first = wait_for(lambda: cluster.store.nodes().get("node-a"), 30, what="node-a registered")
    # As if the lease had expired while etcd was out of reach.
    cluster.store.client.revoke_lease(first.lease_id)
    assert "node-a" not in cluster.store.nodes()
    again = wait_for(
        lambda: cluster.store.nodes().get("node-a"), 30, what="node-a registered on a new lease"
    )
    assert again.lease_id != first.lease_id
    assert cluster.store.lease_alive(again.lease_id)
    assert "etcd lease lost; registering again" in (cluster.path / "node-a.log").read_text()


def test_a_controller_that_stepped_down_leads_again_while_its_key_is_still_there(etcd):
    store = Store(connect([etcd.endpoint], 5))
    mine, theirs = store.client.lease(30), store.client.lease(30)
    term = store.campaign("ctl-a", "127.0.0.1:1", mine.id)
    assert term
    assert store.campaign("ctl-b", "127.0.0.1:2", theirs.id) is None
    # A stepped down (etcd was out of reach past its lease) but nobody led since:
    # the key is still A's, so A takes it again rather than waiting for it to lapse,
    # and its term is unchanged.
    assert store.campaign("ctl-a", "127.0.0.1:1", mine.id) == term
    leader = store.leader()
    assert (leader.address, leader.id, leader.term) == ("127.0.0.1:1", "ctl-a", term)
    # Once A's lease is gone, the key goes with it: B leads with a larger term, and A
    # may not take it back.
    mine.revoke()
    later = store.campaign("ctl-b", "127.0.0.1:2", theirs.id)
    assert later > term
    assert store.campaign("ctl-a", "127.0.0.1:1", mine.id) is None
    assert store.leader().id == "ctl-b"
