"""The pure rules behind the controller's bounds: which batches of step reports are
refused before any lock (too large, of no job, of a generation the node is not part
of), and which agents' sessions are forgotten (down for long, or past the newest kept)."""

import pytest

from common.steps import MAX_BATCH_REPORTS
from orchestrator.policy.authority import Reporting, batch_refusal
from orchestrator.policy.retention import SESSION_KEPT_S, sessions_to_forget

JOB = Reporting(generation=7, nodes=frozenset({"a", "b"}))


@pytest.mark.parametrize(
    "node, job, generation, entries, reports, reporting, refusal",
    [
        ("a", "demo", 7, 10, 80, JOB, ""),
        ("a", "demo", 7, MAX_BATCH_REPORTS, MAX_BATCH_REPORTS, JOB, ""),
        (
            "a",
            "demo",
            7,
            MAX_BATCH_REPORTS + 1,
            MAX_BATCH_REPORTS + 1,
            JOB,
            f"a sent a batch of {MAX_BATCH_REPORTS + 1} steps ({MAX_BATCH_REPORTS + 1} rank "
            f"reports); a batch carries at most {MAX_BATCH_REPORTS}",
        ),
        # Few steps, but of many ranks each: the ranks count too.
        (
            "a",
            "demo",
            7,
            3,
            MAX_BATCH_REPORTS + 3,
            JOB,
            f"a sent a batch of 3 steps ({MAX_BATCH_REPORTS + 3} rank reports); "
            f"a batch carries at most {MAX_BATCH_REPORTS}",
        ),
        ("a", "gone", 7, 1, 1, None, "a reported steps of job 'gone', which does not exist"),
        (
            "c",
            "demo",
            7,
            1,
            1,
            JOB,
            "c reported steps of generation 7 of demo, which it is not part of",
        ),
        # Another generation than the one published: judged under the lock.
        ("c", "demo", 8, 1, 1, JOB, ""),
        ("c", "demo", 6, 1, 1, JOB, ""),
    ],
)
def test_a_batch_is_refused_before_any_lock_when_too_large_or_of_no_job_of_the_node(
    node, job, generation, entries, reports, reporting, refusal
):
    assert (
        batch_refusal(node, job, generation, entries, reports, reporting, MAX_BATCH_REPORTS)
        == refusal
    )


def test_sessions_down_for_longer_than_kept_are_forgotten():
    now = 10_000.0
    down = [("old", now - SESSION_KEPT_S - 1), ("recent", now - 5), ("edge", now - SESSION_KEPT_S)]
    assert sessions_to_forget(now, down, SESSION_KEPT_S, max_kept=100) == ["old"]
    assert sessions_to_forget(now, [], SESSION_KEPT_S, max_kept=100) == []


def test_past_the_newest_kept_the_oldest_sessions_are_forgotten_whatever_their_age():
    """However many node names come and go, at most ``max_kept`` of them are held."""
    now = 100.0
    down = [(f"node-{i}", now - i) for i in range(10)]  # node-0 went down last
    assert sessions_to_forget(now, down, SESSION_KEPT_S, max_kept=3) == [
        f"node-{i}" for i in range(3, 10)
    ]
    assert sessions_to_forget(now, down, SESSION_KEPT_S, max_kept=0) == [n for n, _ in down]
