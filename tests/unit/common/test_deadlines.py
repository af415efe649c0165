"""The deadline chain: derived where not given, and every broken relation named with
its fix."""

import pytest

from common import deadlines
from common.deadlines import DeadlineError, resolve


def test_defaults_fit_and_derived_timeouts_grow_with_the_floor():
    d = resolve()
    assert (d.hang_floor_s, d.stop_grace_s, d.collective_timeout_s) == (30.0, 5.0, 60.0)
    assert d.startup_timeout_s >= 1.2 * (d.first_step_timeout_s + d.stop_grace_s)
    # keel up --hang-floor-s 90: the collective timeout is raised past the floor, or at
    # 60 s it would fire before the agent could name the hung rank.
    assert resolve(hang_floor_s=90).collective_timeout_s == 114.0  # 1.2 x (90 + 5)
    assert resolve(hang_floor_s=90, stop_grace_s=15).collective_timeout_s == 126.0


@pytest.mark.parametrize(
    "given, message",
    [
        (
            {"hang_floor_s": 90, "collective_timeout_s": 60},
            "collective_timeout_s=60: "
            "must be at least 1.2 x (hang_floor_s=90 + stop_grace_s=5.0) = 114",
        ),
        (
            {"first_step_timeout_s": 300, "startup_timeout_s": 300},
            "startup_timeout_s=300: "
            "must be at least 1.2 x (first_step_timeout_s=300 + stop_grace_s=5.0)",
        ),
        (
            {"collective_timeout_s": 400, "startup_timeout_s": 380},
            "startup_timeout_s=380: must be at least collective_timeout_s=400",
        ),
        ({"hang_floor_s": 0.5}, "hang_floor_s=0.5: must be at least 1 s and 2 report periods"),
        ({"heartbeat_s": 20}, "hang_floor_s=30.0: must be at least 1 s and 2 report periods"),
        ({"hang_floor_s": 500}, "first_step_timeout_s=300.0: must be at least hang_floor_s=500"),
        (
            {"reconnect_max_s": 10, "node_lost_grace_s": 10},
            "reconnect_max_s=10: must be below node_lost_grace_s=10",
        ),
        ({"lease_ttl_s": 1}, "lease_ttl_s=1: must be at least 2 s"),
        ({"stop_grace_s": float("nan")}, "stop_grace_s=nan: must be a finite number"),
        ({"hang_floor_s": -3}, "hang_floor_s=-3: must be a finite number of seconds above 0"),
        # Found by the controller's fuzz test: a huge floor overflowed the derived timeouts
        # to infinity, and SubmitJob answered UNKNOWN ("cannot convert float infinity").
        (
            {"hang_floor_s": 1.4980776123852633e308},
            "hang_floor_s=1.4980776123852633e+308: must be a finite number of seconds above 0 and "
            "at most 2592000 (30 days)",
        ),
    ],
)
def test_a_broken_relation_is_refused_with_the_fix(given, message):
    with pytest.raises(DeadlineError) as caught:
        resolve(**given)
    assert any(problem.startswith(message) for problem in caught.value.problems), (
        caught.value.problems
    )


def test_every_problem_is_reported_at_once_and_unknown_names_are_a_bug():
    with pytest.raises(DeadlineError) as caught:
        resolve(hang_floor_s=500, reconnect_max_s=20)
    assert len(caught.value.problems) == 3
    with pytest.raises(TypeError, match="unknown deadline"):
        resolve(hang_timeout_s=3)


def test_a_lease_path_fits_a_stalled_member_and_a_retry_in_its_ttl():
    # The derived deadline fits: 1.2 x (ttl/4 + 2 x ttl/5 + ttl/12) = 0.88 x ttl.
    for ttl in (2.0, 5.0, 60.0):
        assert deadlines.lease_path_problems("t", ttl, deadlines.lease_call_timeout_s(ttl)) == []
    # The controller's old shape, a 5 s call on a 5 s leader lease, does not.
    (problem,) = deadlines.lease_path_problems("leader_ttl_s", 5.0, 5.0)
    assert problem.startswith("leader_ttl_s=5.0: its etcd calls have a deadline of 5 s")
    assert "at most 1.25 s or raise leader_ttl_s" in problem
    assert deadlines.lease_path_problems("t", 5.0, 0.0) != []


@pytest.mark.parametrize(
    "stop_grace_s, stop_deadline_s",
    [
        (1.0, 15.0),  # 1.2 x (2 x 1 + 5) = 8.4: the floor
        (5.0, 18.0),  # 1.2 x (2 x 5 + 5)
        (30.0, 78.0),  # 1.2 x (2 x 30 + 5)
    ],
)
def test_the_stop_deadline_covers_a_park_a_grace_and_the_reap_wait_with_a_floor(
    stop_grace_s, stop_deadline_s
):
    assert resolve(stop_grace_s=stop_grace_s).stop_deadline_s == stop_deadline_s


def test_a_stop_deadline_shorter_than_a_stop_that_goes_well_is_refused():
    with pytest.raises(DeadlineError) as caught:
        resolve(stop_grace_s=10, stop_deadline_s=20)
    (problem,) = caught.value.problems
    assert problem.startswith(
        "stop_deadline_s=20: must be at least 1.2 x (2 x stop_grace_s=10 + 5 s to reap) = 30"
    ), problem
    assert resolve(stop_grace_s=10, stop_deadline_s=30).stop_deadline_s == 30
