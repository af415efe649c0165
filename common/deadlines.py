"""The deadlines that span processes, resolved and checked in one function.

A fault has to run through them in order, each noticed before the next one fires, or
the root cause is buried under the symptoms it causes:

- a rank's progress reaches its agent every ``heartbeat_s``: the least time without
  progress that counts as a hang, ``hang_floor_s``, must be several of those;
- the first step and a step that saves a checkpoint have budgets of their own
  (``first_step_timeout_s``, ``checkpoint_timeout_s``), never below the floor;
- an agent names a hung rank (after the floor at the earliest) and stops its ranks
  (``stop_grace_s`` between SIGTERM and SIGKILL) before the peers' collectives time
  out (``collective_timeout_s``), and likewise at start-up (``startup_timeout_s``,
  the collective timeout until the first step is done);
- a node stops a generation's ranks (a rank that can restart in place has up to a
  stop grace to park first, then ``stop_grace_s`` from SIGTERM to SIGKILL, then
  ``procs.REAP_WAIT_S`` for the process to be reaped) and confirms it within
  ``stop_deadline_s``, or the controller counts it lost for the generation: a rank that
  SIGKILL does not end (stuck in uninterruptible I/O on a hung mount) never holds up the
  job;
- an agent reconnecting with back-off (at most ``reconnect_max_s`` between tries:
  after a failover, or a blip) is back before its node counts as lost
  (``node_lost_grace_s``).

``lease_ttl_s`` (a dead node is noticed after it) and ``leader_ttl_s`` (a standby
takes over within it) have lower bounds, and each bounds the deadline of the etcd calls
that keep its lease alive (``lease_path_problems``): a refresh sent to a member that
stalls must fail, and its retry on another member succeed, before the lease lapses.
Every value is seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from common.procs import REAP_WAIT_S

# A later deadline must exceed the earlier one plus the stop grace by this factor:
# detection and stopping take scheduling slack on a busy node too.
MARGIN = 1.2
COLLECTIVE_TIMEOUT_S = 60.0  # defaults, raised when the chain needs more
STARTUP_TIMEOUT_S = 300.0
HEARTBEATS_PER_FLOOR = 2
# The least stop deadline: a stop goes from the controller's tick over a stream to the
# agent's loop, and its confirmation back, each on a busy node.
STOP_DEADLINE_FLOOR_S = 15.0
MIN_LEASE_S = 2.0  # etcd leases shorter than this expire under load
# An agent's stream to the controller opens with its Hello, made from what the agent
# holds in memory: a stream that has said nothing this long after the controller took
# it is not an agent's, and is closed (DEADLINE_EXCEEDED) rather than hold one of the
# calls the controller serves at once. Seconds: room for a loaded controller's event
# loop in a whole cluster's reconnection, where each Hello waits its turn.
HELLO_TIMEOUT_S = 10.0
# A lease keeper (the agent's and the leader's) refreshes every LEASE_REFRESHES_PER_TTL-th
# of a TTL, and after a failed refresh tries again a LEASE_RETRIES_PER_TTL-th of a TTL
# later (not at once: with every member out of reach the client fails at once, and would
# spin); each call has the deadline ``lease_call_timeout_s``.
LEASE_REFRESHES_PER_TTL = 4
LEASE_RETRIES_PER_TTL = 12
LEASE_CALLS_PER_TTL = 5


class DeadlineError(ValueError):
    """Deadlines that do not fit together; ``problems`` lists each with its fix."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Deadlines:
    heartbeat_s: float = 0.5
    hang_floor_s: float = 30.0
    first_step_timeout_s: float = 300.0
    checkpoint_timeout_s: float = 300.0
    stop_grace_s: float = 5.0
    collective_timeout_s: float = 0.0  # 0: derived (see resolve)
    startup_timeout_s: float = 0.0  # 0: derived
    lease_ttl_s: float = 5.0
    node_lost_grace_s: float = 10.0
    leader_ttl_s: float = 5.0
    reconnect_max_s: float = 5.0
    stop_deadline_s: float = 0.0  # 0: derived


def least_collective_timeout_s(hang_floor_s: float, stop_grace_s: float) -> float:
    return MARGIN * (hang_floor_s + stop_grace_s)


def least_startup_timeout_s(first_step_timeout_s: float, stop_grace_s: float) -> float:
    return MARGIN * (first_step_timeout_s + stop_grace_s)


def least_stop_deadline_s(stop_grace_s: float) -> float:
    """The worst stop of a rank that exits: the park window (a stop grace at most),
    the stop grace, the reap wait, with the margin."""
    return MARGIN * (2 * stop_grace_s + REAP_WAIT_S)


def derived_stop_deadline_s(stop_grace_s: float) -> float:
    """The stop deadline ``resolve`` derives for ``stop_grace_s``."""
    return max(STOP_DEADLINE_FLOOR_S, float(math.ceil(least_stop_deadline_s(stop_grace_s))))


def resolve(**given: float) -> Deadlines:
    """The deadlines with every value not given (or given as 0) filled in: the
    collective and start-up timeouts are derived from the chain (at least their
    defaults, more when the hang floor, the first-step budget or the stop grace need
    it), the stop deadline from the stop grace (at least ``STOP_DEADLINE_FLOOR_S``),
    the rest take ``Deadlines``' defaults. Raises DeadlineError listing every
    relation that does not hold, with its fix."""
    unknown = set(given) - {f.name for f in fields(Deadlines)}
    if unknown:
        raise TypeError(f"unknown deadline(s): {', '.join(sorted(unknown))}")
    values = {f.name: given.get(f.name) or f.default for f in fields(Deadlines)}
    problems = _not_seconds({k: v for k, v in values.items() if v})
    if problems:
        raise DeadlineError(problems)
    d = Deadlines(**values)
    collective = d.collective_timeout_s or max(
        COLLECTIVE_TIMEOUT_S,
        float(math.ceil(least_collective_timeout_s(d.hang_floor_s, d.stop_grace_s))),
    )
    startup = d.startup_timeout_s or max(
        STARTUP_TIMEOUT_S,
        collective,
        float(math.ceil(least_startup_timeout_s(d.first_step_timeout_s, d.stop_grace_s))),
    )
    stop = d.stop_deadline_s or derived_stop_deadline_s(d.stop_grace_s)
    d = Deadlines(
        **{
            **values,
            "collective_timeout_s": collective,
            "startup_timeout_s": startup,
            "stop_deadline_s": stop,
        }
    )
    problems = check(d)
    if problems:
        raise DeadlineError(problems)
    return d


# No deadline of a job is longer than this: one that is, e.g. 1e308 s, is a typo, and
# the deadlines derived from it (1.2 x the sum of two) would overflow to infinity.
MAX_DEADLINE_S = 30 * 24 * 3600.0


def _not_seconds(values: dict[str, object]) -> list[str]:
    return [
        f"{name}={value}: must be a finite number of seconds above 0 and at most "
        f"{MAX_DEADLINE_S:.0f} (30 days)"
        for name, value in values.items()
        if not (
            isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_DEADLINE_S
        )
    ]


def check(d: Deadlines) -> list[str]:
    """Every relation of the chain that ``d`` breaks, each with its fix; [] if none."""
    problems = _not_seconds({f.name: getattr(d, f.name) for f in fields(Deadlines)})
    if problems:
        return problems
    if d.hang_floor_s < max(1.0, HEARTBEATS_PER_FLOOR * d.heartbeat_s):
        problems.append(
            f"hang_floor_s={d.hang_floor_s}: must be at least 1 s and "
            f"{HEARTBEATS_PER_FLOOR} report periods ({HEARTBEATS_PER_FLOOR} x "
            f"heartbeat_s={d.heartbeat_s}): a rank reporting on time would look "
            f"hung; raise hang_floor_s"
        )
    for name in ("first_step_timeout_s", "checkpoint_timeout_s"):
        if getattr(d, name) < d.hang_floor_s:
            problems.append(
                f"{name}={getattr(d, name)}: must be at least hang_floor_s="
                f"{d.hang_floor_s}: start-up and saves take longer than a step; "
                f"raise {name} or lower hang_floor_s"
            )
    least = least_collective_timeout_s(d.hang_floor_s, d.stop_grace_s)
    if d.collective_timeout_s < least:
        problems.append(
            f"collective_timeout_s={d.collective_timeout_s}: must be at least "
            f"{MARGIN:g} x (hang_floor_s={d.hang_floor_s} + stop_grace_s="
            f"{d.stop_grace_s}) = {least:g}: the agent must name a hung rank "
            f"and stop it before its peers' collectives time out; raise "
            f"collective_timeout_s (or leave it out: it is derived) or lower "
            f"hang_floor_s"
        )
    least = least_startup_timeout_s(d.first_step_timeout_s, d.stop_grace_s)
    if d.startup_timeout_s < least:
        problems.append(
            f"startup_timeout_s={d.startup_timeout_s}: must be at least "
            f"{MARGIN:g} x (first_step_timeout_s={d.first_step_timeout_s} + "
            f"stop_grace_s={d.stop_grace_s}) = {least:g}: a rank stuck before "
            f"its first step must be named before its peers time out; raise "
            f"startup_timeout_s (or leave it out) or lower first_step_timeout_s"
        )
    if d.startup_timeout_s < d.collective_timeout_s:
        problems.append(
            f"startup_timeout_s={d.startup_timeout_s}: must be at least "
            f"collective_timeout_s={d.collective_timeout_s}: start-up runs "
            f"collectives too"
        )
    least = least_stop_deadline_s(d.stop_grace_s)
    if d.stop_deadline_s < least:
        problems.append(
            f"stop_deadline_s={d.stop_deadline_s}: must be at least {MARGIN:g} x (2 x "
            f"stop_grace_s={d.stop_grace_s} + {REAP_WAIT_S:g} s to reap) = {least:g}: a "
            f"node whose ranks exit as asked would be counted lost before it could "
            f"confirm the stop; raise stop_deadline_s (or leave it out: it is derived) "
            f"or lower stop_grace_s"
        )
    if d.reconnect_max_s >= d.node_lost_grace_s:
        problems.append(
            f"reconnect_max_s={d.reconnect_max_s}: must be below "
            f"node_lost_grace_s={d.node_lost_grace_s}: an agent backing off "
            f"between reconnects would have its node counted lost; lower the "
            f"agent's reconnect back-off or raise the controller's "
            f"--node-lost-grace-s"
        )
    for name in ("lease_ttl_s", "leader_ttl_s"):
        if getattr(d, name) < MIN_LEASE_S:
            problems.append(
                f"{name}={getattr(d, name)}: must be at least {MIN_LEASE_S:g} s: "
                f"shorter etcd leases expire under ordinary load"
            )
    return problems


def lease_refresh_s(ttl_s: float) -> float:
    """How often a lease of ``ttl_s`` is refreshed."""
    return ttl_s / LEASE_REFRESHES_PER_TTL


def lease_retry_s(ttl_s: float) -> float:
    """How long after a failed refresh of a lease of ``ttl_s`` the next one is sent."""
    return ttl_s / LEASE_RETRIES_PER_TTL


def lease_call_timeout_s(ttl_s: float) -> float:
    """The deadline of each etcd call on the path of a lease of ``ttl_s``: one that
    stalls and a retry both fit in the TTL (``lease_path_problems``)."""
    return ttl_s / LEASE_CALLS_PER_TTL


def lease_path_problems(name: str, ttl_s: float, call_timeout_s: float) -> list[str]:
    """What is wrong with keeping a lease of ``ttl_s`` (the value of ``name``) alive
    with etcd calls of ``call_timeout_s``, with the fix; [] if nothing. The worst case:
    a refresh is due, goes to a member that has stalled (or whose traffic is dropped),
    fails at its deadline, and the retry goes to another member: all of it, with the
    margin, within the TTL, or a single stalled member of three lapses the lease."""
    worst_s = lease_refresh_s(ttl_s) + 2 * call_timeout_s + lease_retry_s(ttl_s)
    if call_timeout_s > 0 and MARGIN * worst_s <= ttl_s:
        return []
    most = (ttl_s / MARGIN - lease_refresh_s(ttl_s) - lease_retry_s(ttl_s)) / 2
    return [
        f"{name}={ttl_s}: its etcd calls have a deadline of {call_timeout_s:g} s, but a "
        f"refresh that stalls on one member and its retry on another must fit in the "
        f"TTL: {MARGIN:g} x ({lease_refresh_s(ttl_s):g} s to the refresh + 2 x "
        f"{call_timeout_s:g} s + {lease_retry_s(ttl_s):g} s before the retry) = "
        f"{MARGIN * worst_s:g} s; give etcd calls on the lease path at most "
        f"{max(most, 0):.3g} s or raise {name}"
    ]
