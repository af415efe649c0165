"""Which nodes of a stopping generation are past the stop deadline, and why, as a table."""

import pytest

from orchestrator.policy.stop_deadline import Overdue, Stuck, overdue

HUNG_READ = Stuck(pid=4242, rank=1, state="D", wchan="request_wait_answer")


@pytest.mark.parametrize(
    "now, waiting, stuck, expected",
    [
        # Within the deadline: nobody is overdue yet, stuck or not.
        (117.9, {"b"}, {"b": (HUNG_READ,)}, ()),
        # At it: the node its agent found stuck says so, pid, state and wchan.
        (
            118.0,
            {"b"},
            {"b": (HUNG_READ,)},
            (
                Overdue(
                    "b",
                    "ranks did not exit after SIGKILL: pid 4242 (rank 1) in "
                    "uninterruptible sleep (wchan request_wait_answer)",
                ),
            ),
        ),
        # One whose agent said nothing (stalled, or its report is lost): its silence.
        (200.0, {"c"}, {}, (Overdue("c", "did not confirm the stop within 18 s"),)),
        # Every process named, an unknown state and wchan as such; nodes sorted.
        (
            120.0,
            {"z", "a"},
            {"z": (Stuck(7, 0, "D", "0"), Stuck(8, 0, "X", ""))},
            (
                Overdue("a", "did not confirm the stop within 18 s"),
                Overdue(
                    "z",
                    "ranks did not exit after SIGKILL: pid 7 (rank 0) in uninterruptible "
                    "sleep, pid 8 (rank 0) in state X",
                ),
            ),
        ),
        # Everyone confirmed (or was counted lost): nothing waits.
        (500.0, set(), {"b": (HUNG_READ,)}, ()),
        # A report about a node that no longer waits names nothing.
        (
            500.0,
            {"a"},
            {"b": (HUNG_READ,)},
            (Overdue("a", "did not confirm the stop within 18 s"),),
        ),
    ],
)
def test_a_node_past_the_stop_deadline_is_overdue_with_the_reason(now, waiting, stuck, expected):
    assert overdue(now, 100.0, 18.0, frozenset(waiting), stuck) == expected
