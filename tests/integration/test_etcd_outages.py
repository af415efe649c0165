"""etcd restarts and lost leases, with a real etcd and real controller/agent processes."""

from __future__ import annotations

import time

import etcd3
import pytest

from common.etcd import EtcdClient, EtcdCredentials, connect
from orchestrator.controller.store import Store
from protos import keel_pb2
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


def test_a_running_jobs_nodes_whose_leases_etcd_revoked_register_again_and_it_runs_on(
    cluster, etcd
):
    """etcd revokes the agents' leases while the controller keeps its own (etcd before
    3.5.11 revokes every lease, one by one, when a stalled raft leader resumes: CI saw
    the controller, between the nodes' leases and its own, count both nodes of a
    running job lost and fail it). Their agents are alive, their streams up: each gets
    its lease TTL to register again, and the job keeps its generation and processes."""
    grace_s = 6.0  # a node with no record is lost at once only this long into a lead
    cluster.controller(
        launcher=("-m", "orchestrator.cli", "controller", "--node-lost-grace-s", str(grace_s))
    )
    leading_since = time.monotonic()
    nodes = {"node-a", "node-b"}
    for node in sorted(nodes):
        cluster.agent(node, ttl="3", slots="1")
    wait_for(lambda: nodes <= set(cluster.store.nodes()), 30, what="both agents registered")
    pids, ranks = cluster.sleepers("steady", 2, "max_restarts = 0\n")
    wait_for(
        lambda: time.monotonic() - leading_since > grace_s, 30, what="the lead's first grace over"
    )
    first = cluster.store.nodes()
    for node in sorted(nodes):
        cluster.store.client.revoke_lease(first[node].lease_id)

    def registered_again() -> bool:
        found = cluster.store.nodes()
        return nodes <= set(found) and all(found[n].lease_id != first[n].lease_id for n in nodes)

    wait_for(registered_again, 30, what="both nodes registered again on new leases")
    for node in sorted(nodes):
        log = (cluster.path / f"{node}.log").read_text()
        assert "etcd lease lost; registering again" in log
    # The controller put the new records (an agent registers through its Hello): a
    # node it counted lost, it did while the record was gone, before now.
    state = cluster.store.job_state("steady").value
    assert (state.state, state.generation, state.restarts) == ("RUNNING", 1, 0), state
    assert {p.name: int(p.read_text()) for p in pids.iterdir()} == ranks
    lost = [
        r.event.reason
        for r in cluster.store.events("steady")
        if r.event.kind == keel_pb2.EVENT_KIND_NODE_LOST
    ]
    assert not lost, lost
