"""A standby's refusal names the leader in words an agent reads back."""

from common.leader import named_leader, standby_refusal


def test_the_leader_a_refusal_names_is_read_back():
    assert named_leader(standby_refusal("10.0.0.7:7070")) == "10.0.0.7:7070"
    assert standby_refusal(None) == "standby controller; the leader is at unknown"
    for details in (standby_refusal(None), "", None, "deadline exceeded", "standby controller"):
        assert named_leader(details) is None, details
    # Anything past the address is not an address.
    assert named_leader(standby_refusal("h:1 and more")) is None
