"""Agents reconnect with jittered exponential back-off (agent/link.jittered)."""

import random

from agent.link import jittered


def test_reconnect_waits_spread_between_half_and_all_of_the_back_off():
    rng = random.Random(7)
    waits = [jittered(2.0, rng) for _ in range(1000)]
    assert all(1.0 <= w <= 2.0 for w in waits)
    # A thousand agents that lost their leader together do not retry in step: their
    # waits fill the interval (each tenth of it holds some), not one instant.
    tenths = {int((w - 1.0) * 10) for w in waits}
    assert tenths >= set(range(10))
