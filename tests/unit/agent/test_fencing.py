"""Self-fencing, as a table: a running node stops its ranks only when it has renewed
no lease for a whole TTL, no controller vouches for it, and no hold from a leading
controller (etcd out for everyone) is left; a hold runs out."""

import math

import pytest

from agent.policy.fencing import hold_until, self_fence

TTL = 10.0
NEVER = -math.inf  # no hold was ever received


@pytest.mark.parametrize(
    "running, unrenewed_s, controller_up, hold_left_s, fenced",
    [
        (True, TTL, False, NEVER, True),
        (True, TTL + 5, False, NEVER, True),
        (True, TTL - 0.1, False, NEVER, False),  # within a TTL: the lease may still hold
        (False, TTL * 3, False, NEVER, False),  # nothing running to stop
        (True, TTL * 3, True, NEVER, False),  # a controller vouches for the node
        (True, TTL * 3, False, 2.0, False),  # etcd is out for everyone: nobody replaces
        (True, TTL * 3, False, 0.0, True),  # the hold ran out: nobody renewed it
        (True, TTL * 3, False, -7.0, True),
    ],
)
def test_a_node_cut_off_for_a_whole_ttl_stops_its_ranks(
    running, unrenewed_s, controller_up, hold_left_s, fenced
):
    why = self_fence(running, unrenewed_s, TTL, controller_up, hold_left_s)
    assert bool(why) is fenced
    if fenced:
        held = " and the controller's hold on it ran out" if hold_left_s > NEVER else ""
        assert why == (
            f"self-fenced: no lease renewal for {unrenewed_s:.1f} s (TTL 10 s) "
            f"and no controller reachable{held}"
        )


@pytest.mark.parametrize(
    "hold_s, until",
    [
        (4.0, 104.0),
        (0.0, 100.0 + TTL),  # an older controller names no length: one lease TTL
        (-1.0, 100.0 + TTL),
        (math.nan, 100.0 + TTL),
        (math.inf, 100.0 + TTL),  # never "for good"
    ],
)
def test_a_hold_runs_out(hold_s, until):
    assert hold_until(100.0, hold_s, TTL) == until
