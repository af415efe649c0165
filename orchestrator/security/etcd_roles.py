"""Who may touch which etcd keys: the users and roles of etcd's auth, from the key
layout (``common.keys``). Pure: ``orchestrator.security.etcd_setup`` applies it.

Each party is an etcd user named as its certificate's common name
(``orchestrator.security.certs``: etcd with ``--client-cert-auth`` takes the CN as the
user), holding one role of the same name:

    keel-controller       readwrite every key under /keel/
    keel-operator         the same: ``keel up``'s own client, ``keel restore-epoch``
    keel-agent-<NODE>     read the leader key; write its own node key only
    keel-agent            (the one certificate of every agent) read the leader key only
    root                  etcd's own: every key and etcd's auth; the operator's alone

What an agent does with etcd: it grants, refreshes and revokes its lease, and reads
and watches the leader key (``common.leader.LeaderWatch``). Its node record is written
by the controller, on the agent's lease; granting and refreshing a lease need no key
permission, but etcd revokes a lease only for a user who may write every key on it,
so an agent that revokes its lease as it stops (its record goes at once) needs write
permission on its own node key. etcd's permissions are key ranges, one set per role,
with nothing that names the caller, so a role shared by every agent cannot grant "its
own node key" without granting every node's: that is why each node has a user and
role of its own. An agent of the shared certificate cannot revoke its lease (the
refusal is logged); its record goes when the lease expires, a TTL later.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from common import keys
from common.keys import NODE_NAME, NODE_NAME_RULE

ROOT = "root"
CONTROLLER = "keel-controller"
OPERATOR = "keel-operator"
SHARED_AGENT = "keel-agent"
AGENT_PREFIX = "keel-agent-"  # then the node's name: ``orchestrator.security.auth``


class Access(Enum):
    """etcd's ``authpb.Permission.Type``, by its value."""

    READ = 0
    WRITE = 1
    READWRITE = 2


@dataclass(frozen=True)
class Grant:
    """``access`` to the keys from ``key`` up to ``range_end`` (exclusive); "" for
    ``range_end``: the one key."""

    access: Access
    key: str
    range_end: str = ""

    def covers(self, key: str) -> bool:
        if not self.range_end:
            return key == self.key
        return self.key <= key < self.range_end


@dataclass(frozen=True)
class Role:
    """An etcd role, and the user of the same name holding it."""

    name: str
    grants: tuple[Grant, ...]

    def may(self, access: Access, key: str) -> bool:
        """Whether this role may ``access`` (READ or WRITE) ``key``."""
        return any(
            grant.covers(key) and grant.access in (access, Access.READWRITE)
            for grant in self.grants
        )


def prefix(key_prefix: str, access: Access) -> Grant:
    """``access`` to every key starting with ``key_prefix``."""
    end = key_prefix[:-1] + chr(ord(key_prefix[-1]) + 1)
    return Grant(access, key_prefix, end)


def agent_user(node: str) -> str:
    """The etcd user (and role) of node ``node``'s agent; raises ValueError with the
    rule for a name no node may have."""
    if not NODE_NAME.match(node):
        raise ValueError(f"node {node!r}: {NODE_NAME_RULE}")
    return AGENT_PREFIX + node


def controller_role() -> Role:
    return Role(CONTROLLER, (prefix(keys.PREFIX + "/", Access.READWRITE),))


def operator_role() -> Role:
    return Role(OPERATOR, (prefix(keys.PREFIX + "/", Access.READWRITE),))


def agent_role(node: str | None = None) -> Role:
    """The role of node ``node``'s agent; None: of the certificate every agent shares."""
    leader = Grant(Access.READ, keys.LEADER)
    if node is None:
        return Role(SHARED_AGENT, (leader,))
    return Role(agent_user(node), (leader, Grant(Access.WRITE, keys.node(node))))


def roles(agents: tuple[str, ...] = ()) -> tuple[Role, ...]:
    """Every role (and user) but root's: per-node agents' for ``agents``, else the
    shared agent's, as ``keel certs init`` writes their certificates."""
    agent_roles = [agent_role(node) for node in dict.fromkeys(agents)] or [agent_role()]
    return (controller_role(), operator_role(), *agent_roles)
