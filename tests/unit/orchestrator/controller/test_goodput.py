"""Goodput accounting over timelines built by hand: every second in one bucket, steps
after the restored checkpoint moved to recompute, and no bucket ever shrinking."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.steps import summarize
from orchestrator.controller.goodput import BUCKETS, Goodput
from orchestrator.controller.sessions import _checked_steps
from orchestrator.policy.lifecycle import JobState
from protos import keel_pb2


def report(rank, step, at, own, checkpoint_s=0.0, restore_s=0.0):
    return keel_pb2.StepReport(
        rank=rank, step=step, at=at, step_time_s=own, checkpoint_s=checkpoint_s, restore_s=restore_s
    )


def tallies(reports):
    """The reports as the controller reads a node's message: a ``StepTally`` a step."""
    checked, invalid, _ = _checked_steps(
        keel_pb2.StepReportBatch(node_steps=summarize(reports)), frozenset(range(64))
    )
    assert not invalid
    return checked


def test_a_run_with_a_crash_adds_up_and_blames_the_right_buckets():
    g = Goodput(submitted_at=0.0, straggler_slowdown=1.25)
    g.waiting(1.0, for_capacity=True)
    g.waiting(10.0, for_capacity=False)
    g.on_state(10.0, JobState.STARTING, generation=1, world_size=2)
    g.on_state(12.0, JobState.RUNNING)
    g.preflight(1, 3.0)
    g.steps(1, tallies([report(0, 1, 20.0, 2.0), report(1, 1, 19.9, 2.0)]), now=20.5)
    assert g.first_step["started_at"] == 18.0
    g.steps(1, tallies([report(0, 2, 22.0, 1.0), report(1, 2, 22.0, 1.0)]), now=22.5)
    # Rank 1 takes 3 s against the other's 1 s: 2 s of the step are straggler slowdown.
    g.steps(1, tallies([report(0, 3, 25.0, 1.0), report(1, 3, 25.0, 3.0)]), now=25.5)
    g.settle(2)
    g.steps(
        1, tallies([report(0, 4, 27.0, 1.0, checkpoint_s=0.5), report(1, 4, 27.0, 1.0)]), now=27.5
    )
    assert g.at_risk_s == pytest.approx(1.0 + 1.5)
    g.on_state(30.0, JobState.STOPPING)  # a crash
    g.on_state(31.0, JobState.PENDING)
    g.waiting(31.0, for_capacity=False)  # backing off
    g.commit_open(33.0)
    g.on_state(35.0, JobState.STARTING, generation=2, world_size=2, restore_step=2)
    g.on_state(36.0, JobState.RUNNING)
    g.steps(2, tallies([report(0, 3, 40.0, 1.0, restore_s=0.4), report(1, 3, 40.0, 1.0)]), now=40.0)
    assert g.first_step == {"step": 3, "started_at": 39.0, "end": 40.0, "restore_s": 0.4}
    g.on_state(41.0, JobState.SUCCEEDED)
    assert g.seconds == pytest.approx(
        {
            "startup": 1 + 5,
            "waiting": 9,
            "preflight": 3,
            "productive": 2 + 2 + 1,
            "straggler": 2,
            "checkpoint": 0.5,
            "recompute": 1 + 1.5,
            "restart": 3 + 1 + 2 + 2 + 1 + 3,
            "shutdown": 1,
        }
    )
    assert g.accounted_s == pytest.approx(41.0)
    assert g.ratio() == pytest.approx(5 / 41)


def test_a_step_waits_for_every_rank_unless_a_report_was_lost():
    g = Goodput(0.0, 1.25)
    g.on_state(0.0, JobState.STARTING, generation=1, world_size=2)
    g.on_state(1.0, JobState.RUNNING)
    g.steps(1, tallies([report(0, 1, 3.0, 1.0)]), now=3.0)
    assert g.last_step == 0  # rank 1 has not reported step 1
    g.steps(1, tallies([report(0, 2, 4.0, 1.0), report(0, 3, 5.0, 1.0)]), now=5.0)
    assert g.last_step == 1  # step 3 arrived: 1 is closed as is
    g.steps(1, tallies([report(1, 2, 4.0, 1.0), report(1, 3, 5.0, 1.0)]), now=5.0)
    assert g.last_step == 3
    g.steps(1, tallies([report(0, 3, 9.0, 1.0)]), now=9.0)  # a repeat changes nothing
    assert g.cursor == 5.0


def test_reports_of_another_generation_and_absurd_times_are_contained():
    g = Goodput(100.0, 1.25)
    g.on_state(100.0, JobState.STARTING, generation=2, world_size=1)
    g.on_state(101.0, JobState.RUNNING)
    g.steps(1, tallies([report(0, 1, 102.0, 1.0)]), now=102.0)  # generation 1's: ignored
    assert g.last_step == 0
    # A clock far ahead, and a time before the cursor: clamped to now and the cursor.
    g.steps(2, tallies([report(0, 1, 1e12, 1.0, checkpoint_s=float("inf"))]), now=103.0)
    g.steps(2, tallies([report(0, 2, 50.0, 1.0)]), now=104.0)
    assert g.cursor == 103.0
    assert g.accounted_s + g.at_risk_s == pytest.approx(g.cursor - g.start)


def test_an_operator_stop_is_shutdown_and_unsaved_work_is_lost():
    g = Goodput(0.0, 1.25)
    g.on_state(0.0, JobState.STARTING, generation=1, world_size=1)
    g.on_state(1.0, JobState.RUNNING)
    g.steps(1, tallies([report(0, 1, 3.0, 2.0)]), now=3.0)
    g.on_state(4.0, JobState.STOPPING, stop_requested=True)
    g.on_state(6.0, JobState.CANCELLED)
    assert g.seconds["shutdown"] == 3.0 and g.seconds["recompute"] == 2.0
    g.on_state(9.0, JobState.CANCELLED)  # ended: nothing more is counted
    assert g.accounted_s == 6.0


def test_the_record_restores_the_accounting():
    g = Goodput(0.0, 1.25)
    g.on_state(0.0, JobState.STARTING, generation=1, world_size=1)
    g.on_state(1.0, JobState.RUNNING)
    g.steps(1, tallies([report(0, 1, 3.0, 2.0)]), now=3.0)
    again = Goodput.from_record(g.record(), 1.25)
    assert again.record() == g.record()
    again.on_state(5.0, JobState.SUCCEEDED)
    assert again.accounted_s == 5.0


EVENT = st.one_of(
    st.tuples(
        st.just("steps"), st.integers(1, 3), st.floats(0, 3), st.floats(0.01, 3), st.floats(0, 1)
    ),
    st.tuples(st.just("state"), st.sampled_from(list(JobState)), st.booleans()),
    st.tuples(st.just("waiting"), st.booleans()),
    st.tuples(st.just("settle"), st.integers(0, 30)),
    st.tuples(st.just("preflight"), st.floats(0, 5)),
    st.tuples(
        st.just("commit"),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), EVENT), max_size=40))
def test_no_bucket_shrinks_and_the_time_is_all_there(timeline):
    g = Goodput(0.0, 1.25)
    t, step, generation = 0.0, 0, 0
    before = dict(g.seconds)
    for gap, event in timeline:
        t += gap
        kind = event[0]
        if kind == "steps":
            _, ranks, late, own, blocked = event
            step += 1
            g.steps(
                generation,
                tallies([report(r, step, t - late, own, blocked) for r in range(ranks)]),
                now=t,
            )
        elif kind == "state":
            _, state, stop = event
            if state is JobState.STARTING:
                generation += 1
            g.on_state(
                t,
                state,
                stop_requested=stop,
                generation=generation,
                world_size=2,
                restore_step=step // 2 or None,
            )
        elif kind == "waiting":
            g.waiting(t, event[1])
        elif kind == "settle":
            g.settle(event[1])
        elif kind == "preflight":
            g.preflight(generation, event[1])
        else:
            g.commit_open(t)
        for bucket in BUCKETS:
            assert g.seconds[bucket] >= before[bucket] - 1e-9, bucket
        before = dict(g.seconds)
        assert g.accounted_s + g.at_risk_s == pytest.approx(g.cursor - g.start, abs=1e-6)
        assert g.cursor <= t + 1e-9
