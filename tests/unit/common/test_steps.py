"""Ranks' step reports summed up per step, as the agent sends them."""

import math

from common.steps import summarize
from protos import keel_pb2


def report(rank, step, seconds, **fields):
    return keel_pb2.StepReport(rank=rank, step=step, step_time_s=seconds, **fields)


def test_a_step_carries_its_ranks_in_order_with_their_times_and_the_sums_and_maxima():
    reports = [
        report(3, 2, 0.5, tokens=10, at=102.0, loss=3.0),
        report(2, 1, 0.3, tokens=10, at=100.5, loss=2.5, checkpoint_s=0.2),
        report(1, 1, 0.4, tokens=20, at=101.0, loss=1.5, restore_s=4.0),
        report(2, 2, 0.6, tokens=30, at=101.5, loss=2.0),
    ]
    first, second = summarize(reports)
    assert (first.step, list(first.ranks), list(first.step_time_s)) == (1, [1, 2], [0.4, 0.3])
    assert (first.tokens, first.at, first.checkpoint_s, first.restore_s) == (30, 101.0, 0.2, 4.0)
    assert first.loss == 1.5  # the loss of its first rank
    assert (second.step, list(second.ranks), list(second.step_time_s)) == (2, [2, 3], [0.6, 0.5])
    assert (second.tokens, second.loss) == (40, 2.0)


def test_a_ranks_first_report_of_a_step_counts_and_the_unfit_ones_go_as_steps_of_their_own():
    reports = [
        report(0, 1, 0.2, tokens=5),
        report(0, 1, 9.0, tokens=5),
        report(1, 0, 0.2),
        report(1, 1, math.nan),
        report(2, 1, math.inf),
        report(3, 1, -1.0),
        report(4, 1, 0.0),
    ]
    only, *unfit = summarize(reports)
    assert (list(only.ranks), list(only.step_time_s), only.tokens) == ([0, 4], [0.2, 0.0], 5)
    assert [(list(s.ranks), s.step) for s in unfit] == [([1], 0), ([1], 1), ([2], 1), ([3], 1)]
    times = [s.step_time_s[0] for s in unfit]
    assert math.isnan(times[1]) and times[:1] + times[2:] == [0.2, math.inf, -1.0]


def test_no_reports_make_no_steps():
    assert summarize([]) == []
