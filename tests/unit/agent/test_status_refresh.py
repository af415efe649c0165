"""An unchanged status is sent again every 10 s, or every 10 step batches once the
controller asks for batches long enough (agent/link.status_refresh_s): the refreshes of
a whole cluster stay about as many a second past 1,000 agents, however many they are."""

from agent.link import status_refresh_s
from orchestrator.policy.pacing import REPORT_INTERVALS_S, report_interval_s


def test_the_refresh_is_ten_seconds_at_the_agents_own_pace_and_short_batches():
    assert status_refresh_s(0.0) == 10.0
    assert status_refresh_s(1.0) == 10.0
    assert status_refresh_s(4.0) == 40.0


def test_the_clusters_refreshes_a_second_stay_flat_as_it_grows():
    rates = {}
    interval = 0.0
    for agents in (1_000, 2_000, 4_000, 8_000):
        interval = report_interval_s(agents, 1000.0, interval)
        rates[agents] = agents / status_refresh_s(interval)
    assert rates == {1_000: 100.0, 2_000: 100.0, 4_000: 100.0, 8_000: 100.0}
    # Past the longest interval the pacing asks for, they grow again, slowly.
    longest = status_refresh_s(REPORT_INTERVALS_S[-1])
    assert 16_384 / longest < 16_384 / 10.0 / 7
