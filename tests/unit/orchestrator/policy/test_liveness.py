"""Whether a node still counts, judged from its record, its agent's stream and the
clock."""

import pytest

from orchestrator.policy.liveness import (
    LEAD_TRIES,
    TAKEOVER_GRACES,
    let_go_reason,
    node_usable,
    step_down_reason,
    taking_over,
)

GRACE = 10.0


@pytest.mark.parametrize(
    "since_leading_s, since_knock_s, expected",
    [
        (0.0, 1e9, True),  # just took over: every agent gets the grace
        (GRACE - 0.1, 1e9, True),
        (GRACE, 1e9, False),  # past the grace, and nobody arrives
        (GRACE * 3, GRACE / 2 - 0.1, True),  # a storm still arriving
        (GRACE * 3, GRACE / 2, False),  # none for half a grace
        (TAKEOVER_GRACES * GRACE - 0.1, 0.0, True),
        (TAKEOVER_GRACES * GRACE, 0.0, False),  # the cap, whatever still arrives
    ],
)
def test_a_new_leader_waits_for_its_cluster_while_it_is_still_coming_back(
    since_leading_s, since_knock_s, expected
):
    assert taking_over(since_leading_s, since_knock_s, GRACE) is expected


@pytest.mark.parametrize(
    "registered, has_session, connected, down_for_s, taking, since_leading_s, expected",
    [
        # No record while connected here: at once (a stalled agent's lease lapsed)...
        (False, True, True, 0.0, False, 1e9, False),
        (False, True, True, 0.0, True, GRACE, False),
        # ...but for the first grace of a lead: after every lease was revoked at once,
        # an agent may connect to the new leader before its refresh registers it again.
        (False, True, True, 0.0, True, 0.0, True),
        (False, True, True, 0.0, True, GRACE - 0.1, True),
        (True, True, True, 0.0, False, 1e9, True),
        (True, True, False, GRACE - 0.1, False, 1e9, True),  # down, within the grace
        (True, True, False, GRACE, False, 1e9, False),
        (True, False, False, 0.0, True, 1e9, True),  # not connected here yet, taking over
        (True, False, False, 0.0, False, 1e9, False),
        # Neither a record nor a stream yet, just after a takeover (every lease revoked
        # at once): the first grace of the lead, however long the takeover goes on.
        (False, False, False, 0.0, True, 0.0, True),
        (False, False, False, 0.0, True, GRACE - 0.1, True),
        (False, False, False, 0.0, True, GRACE, False),
        (False, False, False, 0.0, False, 1e9, False),
    ],
)
def test_a_node_counts_while_registered_and_its_stream_is_up_or_briefly_down(
    registered, has_session, connected, down_for_s, taking, since_leading_s, expected
):
    usable = node_usable(
        registered, has_session, connected, down_for_s, GRACE, taking, since_leading_s
    )
    assert usable is expected


@pytest.mark.parametrize(
    "connected, unregistered_for_s, lease_ttl_s, expected",
    [
        # Its record went while its stream was up (etcd revoked its lease; the leader's
        # own may go next): a TTL to register again, whether its stream is still up or
        # it is reconnecting to do so...
        (True, 0.0, 5.0, True),
        (True, -0.01, 5.0, True),  # it went after the tick read its clock
        (True, 4.9, 5.0, True),
        (False, 4.9, 5.0, True),
        # ...and lost after it (stalled, it did not refresh its lease).
        (True, 5.0, 5.0, False),
        # No record went while its stream was up (its agent died first, or never
        # registered): lost at once.
        (True, float("inf"), 5.0, False),
        (True, 0.0, 0.0, False),  # an agent that said no TTL
    ],
)
def test_a_node_whose_record_went_while_its_stream_was_up_has_a_lease_ttl_to_register(
    connected, unregistered_for_s, lease_ttl_s, expected
):
    usable = node_usable(
        False, True, connected, 0.0, GRACE, False, 1e9, unregistered_for_s, lease_ttl_s
    )
    assert usable is expected


@pytest.mark.parametrize(
    "lapsed, since_refresh_s, reason",
    [
        (False, 0.0, ""),
        (False, GRACE - 0.1, ""),  # an etcd hiccup shorter than the TTL keeps the lead
        (False, GRACE, "could not refresh the leader lease for 10.0 s"),
        (True, 0.0, "leader lease expired"),  # etcd said so: at once
    ],
)
def test_a_leader_steps_down_when_its_lease_lapsed_or_went_unrefreshed_a_ttl(
    lapsed, since_refresh_s, reason
):
    assert step_down_reason(lapsed, since_refresh_s, GRACE) == reason


@pytest.mark.parametrize(
    "failed_tries, expected",
    [
        (0, ""),
        (1, ""),  # one etcd error between pages: try again, holding the key
        (LEAD_TRIES - 1, ""),
        (LEAD_TRIES, f"could not take the lead in {LEAD_TRIES} tries; the last: boom"),
        (LEAD_TRIES + 2, f"could not take the lead in {LEAD_TRIES + 2} tries; the last: boom"),
    ],
)
def test_a_controller_that_cannot_take_the_lead_lets_the_key_go_after_its_tries(
    failed_tries, expected
):
    assert let_go_reason(failed_tries, "boom") == expected
