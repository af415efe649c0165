"""What the controller takes of an agent's step message: a node's steps, checked, one
tuple a step."""

import math

from common.steps import summarize
from orchestrator.controller.sessions import StepTally, _checked_steps
from protos import keel_pb2

MINE = frozenset({4, 5, 6, 7})


def node_step(step, ranks, times, **fields):
    return keel_pb2.NodeStep(step=step, ranks=ranks, step_time_s=times, **fields)


def test_a_node_step_is_read_into_one_tally():
    batch = keel_pb2.StepReportBatch(
        node_steps=[
            node_step(
                3,
                [4, 5, 6, 7],
                [0.5, 0.6, 0.5, 0.7],
                tokens=400,
                at=10.0,
                checkpoint_s=0.1,
                restore_s=2.0,
                loss=1.5,
            )
        ]
    )
    assert _checked_steps(batch, MINE) == (
        [StepTally(3, (4, 5, 6, 7), (0.5, 0.6, 0.5, 0.7), 400, 10.0, 0.1, 2.0, 1.5)],
        0,
        None,
    )


def test_the_agents_summary_of_its_ranks_reports_gives_a_tally_a_step():
    reports = [
        keel_pb2.StepReport(
            rank=rank,
            step=step,
            step_time_s=0.1 * rank + step,
            tokens=10,
            at=100.0 + rank,
            loss=2.0 / step,
        )
        for step in (1, 2)
        for rank in (7, 5, 4, 6)
    ]
    tallies, invalid, theirs = _checked_steps(
        keel_pb2.StepReportBatch(node_steps=summarize(reports)), MINE
    )
    assert (invalid, theirs) == (0, None)
    first, second = tallies
    assert (first.ranks, first.tokens, first.at, first.loss) == ((4, 5, 6, 7), 40, 107.0, 2.0)
    assert (first.step, first.step_times) == (1, tuple(0.1 * rank + 1 for rank in (4, 5, 6, 7)))
    assert (second.step, second.ranks, second.loss) == (2, (4, 5, 6, 7), 1.0)


def test_unfit_steps_are_counted_and_dropped_and_a_foreign_rank_is_named():
    batch = keel_pb2.StepReportBatch(
        node_steps=[
            node_step(0, [4, 5], [0.1, 0.1]),  # steps are numbered from 1
            node_step(1, [4, 5], [0.1, math.nan]),  # not a number of seconds
            node_step(1, [4, 5], [0.1, math.inf]),
            node_step(1, [4, 5], [0.1, -0.1]),
            node_step(1, [4, 5], [0.1]),  # a time missing
            node_step(1, [], []),  # no ranks
            node_step(2, [4, 9, 5, 4], [0.1, 0.2, 0.3, 0.4]),  # rank 9 is not the node's
            node_step(0, [6], [0.1]),  # a rank's report the agent could not sum up
        ],
    )
    tallies, invalid, theirs = _checked_steps(batch, MINE)
    assert invalid == 2 + 2 + 2 + 2 + 2 + 1 + 1
    assert theirs == 9
    (only,) = tallies
    assert (only.step, only.ranks, only.step_times) == (2, (4, 5), (0.1, 0.3))


def test_each_ranks_newest_measured_step_is_kept_whatever_order_the_steps_come_in():
    """JobHealth keeps each rank's newest step with a measured time (what says a window
    may be complete), a node's step at a time when its steps come in order; the same
    as rank by rank when they do not, or some of a node's ranks were not measured."""
    import random

    from orchestrator.controller.job_health import JobHealth
    from orchestrator.spec.health import resolve

    rng = random.Random(7)
    for run in range(50):
        health = JobHealth("j", resolve(keel_pb2.HealthSpec()))
        expected: dict[int, int] = {}
        steps = [0, 0, 0]
        for _ in range(40):
            node = rng.randrange(3)
            ranks = tuple(range(node * 4, node * 4 + 4))
            # In order (now and then a step sent again) in half the runs, any order else.
            steps[node] += rng.randrange(2) if run % 2 else rng.randrange(-5, 6)
            step = max(1, steps[node])
            times = tuple(0.0 if rng.random() < 0.2 else 1.0 for _ in ranks)
            health.add_steps(f"n{node}", [StepTally(step, ranks, times, 0, 0.0, 0.0, 0.0, 0.0)])
            for rank, seconds in zip(ranks, times):
                if seconds > 0 and step > expected.get(rank, 0):
                    expected[rank] = step
        assert health.latest == expected
