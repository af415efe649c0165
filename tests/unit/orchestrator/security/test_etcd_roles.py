"""The etcd roles table: each party may touch exactly the keys it needs."""

from __future__ import annotations

import pytest

from common import keys
from orchestrator.security import etcd_roles
from orchestrator.security.etcd_roles import Access, Grant, agent_role, roles

READ, WRITE = Access.READ, Access.WRITE

# One key of every kind ``common.keys`` spells.
EVERY_KEY = {
    "leader": keys.LEADER,
    "epoch": keys.EPOCH,
    "node": keys.node("node-0"),
    "other node": keys.node("node-1"),
    "node prefix": keys.node("node-00"),
    "cordon": keys.cordon("node-0"),
    "job_spec": keys.job_spec("j"),
    "job_state": keys.job_state("j"),
    "plan": keys.plan("j", 3),
    "plan part": keys.plan_parts("j", 3, "abc") + "0",
    "checkpoint": keys.checkpoint("j", 100),
    "event": keys.event("j", 7),
    "operation": keys.operation("j"),
    "checkpoint_request": keys.checkpoint_request("j"),
}


def allowed(role, access):
    return {name for name, key in EVERY_KEY.items() if role.may(access, key)}


def test_a_nodes_agent_reads_the_leader_key_and_writes_its_own_node_key_only():
    role = agent_role("node-0")
    assert role.name == "keel-agent-node-0"
    assert allowed(role, READ) == {"leader"}
    assert allowed(role, WRITE) == {"node"}


def test_the_shared_agent_role_reads_the_leader_key_and_writes_nothing():
    role = agent_role()
    assert role.name == "keel-agent"
    assert allowed(role, READ) == {"leader"}
    assert allowed(role, WRITE) == set()


@pytest.mark.parametrize("role", [etcd_roles.controller_role(), etcd_roles.operator_role()])
def test_the_controller_and_operator_read_and_write_every_keel_key_and_nothing_else(role):
    assert allowed(role, READ) == allowed(role, WRITE) == set(EVERY_KEY)
    assert not role.may(READ, "/keelx") and not role.may(WRITE, "/other/key")
    assert not role.may(READ, keys.PREFIX)  # no key is "/keel" itself


def test_each_role_is_named_as_its_certificates_common_name():
    from common.node_identity import AGENT_CERT_PREFIX

    assert etcd_roles.AGENT_PREFIX == AGENT_CERT_PREFIX
    names = [r.name for r in roles(("node-0", "node-1", "node-0"))]
    assert names == ["keel-controller", "keel-operator", "keel-agent-node-0", "keel-agent-node-1"]
    assert [r.name for r in roles()] == ["keel-controller", "keel-operator", "keel-agent"]


def test_a_prefix_grant_ends_where_the_prefix_does():
    grant = etcd_roles.prefix("/keel/", Access.READWRITE)
    assert grant == Grant(Access.READWRITE, "/keel/", "/keel0")
    assert grant.covers("/keel/") and grant.covers("/keel/\xff")
    assert not grant.covers("/keel0") and not grant.covers("/keel")


def test_a_node_no_node_may_be_called_has_no_role():
    with pytest.raises(ValueError, match="use 1-63 letters"):
        agent_role("a/b")
