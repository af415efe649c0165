"""Self-fencing, as a table: a running node stops its ranks only when it has renewed
no lease for a whole TTL, no controller vouches for it, and the controller has not
said the outage is everyone's."""

import pytest

from agent.policy.fencing import self_fence

TTL = 10.0


@pytest.mark.parametrize(
    "running, unrenewed_s, controller_up, outage_seen, fenced",
    [
        (True, TTL, False, False, True),
        (True, TTL + 5, False, False, True),
        (True, TTL - 0.1, False, False, False),  # within a TTL: the lease may still hold
        (False, TTL * 3, False, False, False),  # nothing running to stop
        (True, TTL * 3, True, False, False),  # a controller vouches for the node
        (True, TTL * 3, False, True, False),  # etcd is out for everyone: nobody replaces
    ],
)
def test_a_node_cut_off_for_a_whole_ttl_stops_its_ranks(
    running, unrenewed_s, controller_up, outage_seen, fenced
):
    why = self_fence(running, unrenewed_s, TTL, controller_up, outage_seen)
    assert bool(why) is fenced
    if fenced:
        assert why == (
            f"self-fenced: no lease renewal for {unrenewed_s:.1f} s (TTL 10 s) "
            "and no controller reachable"
        )
