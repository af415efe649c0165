import pytest

from orchestrator.policy.pacing import REPORT_INTERVALS_S, report_interval_s


@pytest.mark.parametrize(
    "agents, expected",
    [
        (1, 0.0),
        (500, 0.0),  # 2 messages a second each: 1,000 a second
        (501, 1.0),
        (1000, 1.0),
        (1001, 2.0),
        (2000, 2.0),
        (4000, 4.0),
        (8000, 8.0),
        (16384, 8.0),  # the longest: past it the budget is exceeded
    ],
)
def test_the_interval_keeps_the_agents_within_the_budget(agents, expected):
    assert report_interval_s(agents, 1000.0, 0.0) == expected


def test_a_shrinking_cluster_is_told_a_shorter_interval_only_with_room_to_spare():
    # Asked for 2 s at 1,500 agents; at 900 the 1 s interval would be 90 % full.
    assert report_interval_s(900, 1000.0, 2.0) == 2.0
    assert report_interval_s(800, 1000.0, 2.0) == 1.0
    # Back and forth across 1,000 agents does not flap: 1,000 fits 1 s exactly.
    assert report_interval_s(1000, 1000.0, 1.0) == 1.0
    assert report_interval_s(999, 1000.0, 2.0) == 2.0
    # Down to the agents' own pace (0.5 s) only below 400.
    assert report_interval_s(450, 1000.0, 1.0) == 1.0
    assert report_interval_s(400, 1000.0, 1.0) == 0.0
    assert report_interval_s(10, 1000.0, 8.0) == 0.0


def test_growth_is_followed_at_once_and_every_interval_is_one_of_the_few():
    current, seen = 0.0, []
    for agents in range(0, 20000, 37):
        current = report_interval_s(agents, 1000.0, current)
        if not seen or seen[-1] != current:
            seen.append(current)
    assert seen == list(REPORT_INTERVALS_S)


def test_a_budget_of_nothing_is_refused_with_a_fix():
    with pytest.raises(ValueError, match="messages a second the controller should take"):
        report_interval_s(10, 0.0, 0.0)
