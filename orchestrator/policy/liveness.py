"""Whether a node still counts: the timeout judgements on its agent's stream. Pure:
the controller passes what it knows of the node and the clock readings (monotonic
seconds), and acts on the answer."""

from __future__ import annotations

# A controller that took over waits for a cluster still reconnecting to it at most
# this many node-lost graces (a node that is truly gone is counted lost by then).
TAKEOVER_GRACES = 6

# An "etcd unreachable" hold lasts this many leader TTLs from its last renewal. The
# leader renews it only while it leads, and steps down one TTL into an outage; the hold
# must outlast that by the time a restarted etcd takes to answer and the agents to
# renew their leases (a hold of one TTL fenced every node of a run whose etcd was down
# 7 s on a loaded machine), and still run out soon once nobody renews it.
HOLD_TTLS = 3


# A controller that won the leader key but could not take the lead (its rebuild from
# etcd raised) this many times in a row lets the key go, for a standby to try.
LEAD_TRIES = 3


def let_go_reason(failed_tries: int, error: str) -> str:
    """Why a controller holding the leader key without leading gives it up, or "" while
    it tries again: ``failed_tries`` takeovers in a row raised, the last with
    ``error`` (an etcd error between pages, a record it cannot load: held on, the key
    would keep every standby from leading for good)."""
    if failed_tries < LEAD_TRIES:
        return ""
    return f"could not take the lead in {failed_tries} tries; the last: {error}"


def etcd_hold_s(leader_ttl_s: float) -> float:
    """How long an agent keeps its ranks on a leader's word that etcd is out of
    everyone's reach, from the leader's last renewal (seconds)."""
    return HOLD_TTLS * leader_ttl_s


def taking_over(since_leading_s: float, since_knock_s: float, grace_s: float) -> bool:
    """Whether agents that have not reconnected since this controller began to lead
    (``since_leading_s`` ago) are still given time: for the node-lost grace, and past
    it while the cluster is still coming back (an agent was let in or told to back off
    ``since_knock_s`` ago, within the last half grace: at thousands of nodes the
    reconnect storm outlasts one grace on a busy leader, and counting its tail lost
    would restart a healthy job), up to TAKEOVER_GRACES graces."""
    return since_leading_s < grace_s or (
        since_leading_s < TAKEOVER_GRACES * grace_s and since_knock_s < grace_s / 2
    )


def node_usable(
    registered: bool,
    has_session: bool,
    connected: bool,
    down_for_s: float,
    grace_s: float,
    still_taking_over: bool,
    since_leading_s: float,
    unregistered_for_s: float = float("inf"),
    lease_ttl_s: float = 0.0,
) -> bool:
    """A node counts while it is registered in etcd and its agent's stream is up, or
    down for less than the node-lost grace; a node whose agent has not connected to
    this controller yet counts while the controller is still ``taking_over``; and a node
    with no record counts for the first node-lost grace of this lead
    (``since_leading_s``), whether its agent has connected yet or not: alive, it
    registers again on a new lease at its next refresh. That is what a takeover finds
    after etcd revoked every lease at once (etcd before 3.5.11 does when a raft leader
    that was stalled resumes, etcd-io/etcd#15247; the leader's lease goes too, so a
    takeover always follows), and an agent that learns of the new leader before its
    next refresh connects to it still unregistered; counted lost at once, every node of
    every job was. Past that grace, a node whose record went while its agent's stream
    was up (``unregistered_for_s`` ago; infinite for any other) counts for one lease TTL
    of that agent (``lease_ttl_s``), and is lost after: alive, the agent has refreshed
    its lease by then, found it gone, and connected again to register on a new one;
    stalled, it has not, and that is how it is found, one TTL later than at the record's
    going. Lost at once, every node of a job was when etcd revoked every lease one by
    one: the leader saw the nodes' records go before its own key went, and stopped and
    failed a healthy job in the milliseconds between (CI saw it). A record that went
    after ``now`` was read (the watch's thread noted it since) counts as just gone. An
    agent that died has no such TTL: its stream went down first, and its record's going
    loses it; nor one that said no TTL."""
    if not registered:
        return since_leading_s < grace_s or (0 < lease_ttl_s and unregistered_for_s < lease_ttl_s)
    if not has_session:
        return still_taking_over
    return connected or down_for_s < grace_s


def step_down_reason(lease_lapsed: bool, since_refresh_s: float, ttl_s: float) -> str:
    """Why a leader steps down, or "" while it keeps the lead: its lease lapsed (etcd
    said so), or it could not refresh it for a whole TTL (a refresh within it, or an
    etcd hiccup shorter than it, keeps the lead)."""
    if lease_lapsed:
        return "leader lease expired"
    if since_refresh_s < ttl_s:
        return ""
    return f"could not refresh the leader lease for {since_refresh_s:.1f} s"
