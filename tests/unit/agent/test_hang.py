"""The hang detector, with the clock passed in: times are plain numbers of seconds."""

import re

import pytest

from agent.hang import Hang, HangConfig, RankProgress, find_hang, hang_timeout_s

CONFIG = HangConfig(floor_s=10.0, k=10.0, first_step_timeout_s=60.0, checkpoint_timeout_s=40.0)


def rank(n, report_at=None, step=0, checkpointing=False, started_at=0.0):
    return RankProgress(
        rank=n,
        pid=4240 + n,
        started_at=started_at,
        last_report_at=report_at,
        last_step=step,
        checkpointing=checkpointing,
    )


@pytest.mark.parametrize(
    "name, recent, phase, timeout_s",
    [
        ("no history: the floor", [], "step", 10.0),
        ("short steps: the floor", [0.08, 0.09, 0.07], "step", 10.0),
        ("k x median beyond the floor", [2.0, 1.5, 100.0], "step", 20.0),
        ("before the first step: its own budget", [2.0], "first_step", 60.0),
        ("checkpoint: its own budget", [0.1], "checkpoint", 40.0),
        ("checkpoint: never shorter than a step", [5.0], "checkpoint", 50.0),
    ],
)
def test_timeout_per_phase(name, recent, phase, timeout_s):
    assert hang_timeout_s(CONFIG, recent, phase) == pytest.approx(timeout_s), name


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="phase 'saving': use one of first_step, checkpoint"):
        hang_timeout_s(CONFIG, [], "saving")


def test_nothing_is_declared_until_the_timeout_has_passed():
    ranks = [rank(0, report_at=100.0, step=14), rank(1, report_at=100.0, step=14)]
    recent = [0.08] * 5
    assert find_hang(100.0, ranks, recent, CONFIG) is None
    assert find_hang(110.0, ranks, recent, CONFIG) is None  # exactly the timeout
    hang = find_hang(110.5, ranks, recent, CONFIG)
    assert hang is not None and hang.rank == 0  # a tie: the lowest rank


def test_the_rank_whose_progress_is_oldest_is_named():
    ranks = [
        rank(0, report_at=95.0, step=15),
        rank(1, report_at=90.0, step=14),
        rank(2, report_at=92.0, step=14),
        rank(3, report_at=99.0, step=15),
    ]
    hang = find_hang(102.3, ranks, [0.08, 0.07, 0.09], CONFIG)
    assert hang == Hang(
        rank=1,
        pid=4241,
        last_step=14,
        stalled_for_s=pytest.approx(12.3),
        timeout_s=10.0,
        phase="step",
        reason=(
            "rank 1 (pid 4241) made no progress for 12.3 s after step 14 "
            "(timeout 10.0 s, the floor (10 x median step 0.08 s = 0.8 s))"
        ),
    )


def test_k_times_the_median_step_is_explained():
    hang = find_hang(125.0, [rank(0, report_at=100.0, step=7)], [2.0, 2.5, 1.5], CONFIG)
    assert hang.reason == (
        "rank 0 (pid 4240) made no progress for 25.0 s after step 7 "
        "(timeout 20.0 s = 10 x median step 2 s (floor 10.0 s))"
    )


def test_first_step_budget_counts_from_the_process_start():
    ranks = [rank(0, started_at=5.0), rank(1, report_at=58.0, step=1)]
    assert find_hang(64.0, ranks, [], CONFIG) is None
    hang = find_hang(65.5, ranks, [], CONFIG)
    assert (hang.rank, hang.phase, hang.timeout_s) == (0, "first_step", 60.0)
    assert hang.reason == (
        "rank 0 (pid 4240) made no progress for 60.5 s since it started, "
        "before its first step (first-step timeout 60.0 s)"
    )


def test_a_checkpoint_save_gets_its_own_budget_not_the_step_timeout():
    saving = [rank(0, report_at=100.0, step=20, checkpointing=True)]
    assert find_hang(139.0, saving, [0.1], CONFIG) is None
    hang = find_hang(141.0, saving, [0.1], CONFIG)
    assert (hang.phase, hang.timeout_s) == ("checkpoint", 40.0)
    assert hang.reason == (
        "rank 0 (pid 4240) made no progress for 41.0 s after step 20, "
        "saving a checkpoint (checkpoint timeout 40.0 s)"
    )
    hang = find_hang(161.0, saving, [6.0], CONFIG)
    assert hang.timeout_s == 60.0 and hang.reason.endswith(
        "(timeout 60.0 s = 10 x median step 6 s (floor 10.0 s), above the checkpoint "
        "timeout 40.0 s)"
    )


def test_a_stall_before_the_first_step_outranks_a_later_one():
    # Rank 1 never reported: its progress (its start) is older than rank 0's last step.
    ranks = [rank(0, report_at=30.0, step=3), rank(1, started_at=0.0)]
    assert find_hang(100.0, ranks, [1.0], CONFIG).rank == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(floor_s=0), "floor_s=0: must be positive"),
        (dict(k=-1), "k=-1: must be positive"),
        (dict(checkpoint_timeout_s=0), "checkpoint_timeout_s=0: must be positive"),
        (dict(floor_s=400), "first_step_timeout_s=300.0 must be at least floor_s=400"),
    ],
)
def test_config_validation_says_how_to_fix_it(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HangConfig(**kwargs)


def test_a_rank_that_never_said_it_reports_steps_is_never_hung_before_its_first():
    plain = RankProgress(
        rank=0,
        pid=1,
        started_at=0.0,
        last_report_at=None,
        last_step=0,
        checkpointing=False,
        reports_steps=False,
    )
    assert find_hang(10_000.0, [plain], [], CONFIG) is None
    # One that said so is held to the first-step budget ...
    attached = RankProgress(
        rank=1,
        pid=2,
        started_at=0.0,
        last_report_at=None,
        last_step=0,
        checkpointing=False,
        reports_steps=True,
    )
    assert find_hang(61.0, [plain, attached], [], CONFIG).rank == 1
    # ... and so is a plain script from its first step report on, to the step timeout.
    reported = RankProgress(
        rank=0,
        pid=1,
        started_at=0.0,
        last_report_at=100.0,
        last_step=1,
        checkpointing=False,
        reports_steps=False,
    )
    assert find_hang(111.0, [reported], [], CONFIG).phase == "step"
