"""The trainer's health plumbing that runs without a process group: preflight bandwidth
arithmetic (nccl-tests' formulas against hand-computed figures), its sizes and
summary, the watchdog's NCCL environment and barrier messages (NCCL itself cannot run
here; only the pure construction is tested), the phase timer, and the health flags."""

import time

import pytest
import torch

from trainer import preflight, train, watchdog
from trainer.phases import PhaseTimer
from trainer.preflight import Result, Sweep, bus_bandwidth, sizes_bytes

MIB = 1 << 20


@pytest.mark.parametrize(
    ("collective", "size_bytes", "time_s", "n", "algbw", "busbw"),
    [
        # 8 MiB in 4 ms: 8388608 / 0.004 / 1e9 = 2.097152 GB/s; x 2(4-1)/4 = 1.5.
        ("all_reduce", 8 * MIB, 0.004, 4, 2.097152, 3.145728),
        # 1 GB of gathered output in 0.5 s over 8 ranks: 2 GB/s; x 7/8.
        ("all_gather", 1_000_000_000, 0.5, 8, 2.0, 1.75),
        # 4 MB of input in 1 ms over 2 ranks: 4 GB/s; x 1/2.
        ("reduce_scatter", 4_000_000, 0.001, 2, 4.0, 2.0),
        # 1 MiB in 0.5 ms over 3 ranks: 2.097152 GB/s; all_reduce x 4/3.
        ("all_reduce", MIB, 0.0005, 3, 2.097152, 2.796202666666667),
        # One rank moves nothing over a link: the factor is 0.
        ("all_reduce", MIB, 0.001, 1, 1.048576, 0.0),
        ("all_gather", MIB, 0.001, 1, 1.048576, 0.0),
        ("reduce_scatter", MIB, 0.001, 1, 1.048576, 0.0),
    ],
)
def test_bus_bandwidth_is_nccl_tests_formula(collective, size_bytes, time_s, n, algbw, busbw):
    assert bus_bandwidth(collective, size_bytes, time_s, n) == pytest.approx(
        (algbw, busbw), rel=1e-12
    )


def test_bus_bandwidth_refuses_an_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        bus_bandwidth("broadcast", MIB, 0.001, 2)


def test_sizes_round_down_to_equal_float32_shares():
    assert sizes_bytes([1, 8], 2) == [MIB, 8 * MIB]
    # 1 MiB over 3 ranks: 87381 float32 elements each.
    assert sizes_bytes([1], 3) == [87381 * 4 * 3]
    # Never zero: at least one element per rank.
    assert sizes_bytes([1e-9], 4) == [16]


def test_summary_lists_busbw_per_collective_and_says_when_the_budget_ran_out():
    sweep = Sweep(
        results=[
            Result("all_reduce", MIB, 0.001, 1.048576, 1.048576),
            Result("all_gather", MIB, 0.002, 0.524288, 0.262144),
            Result("reduce_scatter", MIB, 0.002, 0.524288, 0.262144),
            Result("all_reduce", 8 * MIB, 0.004, 2.097152, 2.097152),
        ],
        wall_s=10.4,
        skipped=2,
    )
    line = preflight.summary(sweep, 2, 10.0)
    assert line.startswith(
        "preflight over 2 ranks in 10.40 s, busbw: all_reduce 1.05 GB/s @ 1 MiB, 2.1 GB/s @ 8 MiB; "
        "all_gather 0.262 GB/s @ 1 MiB; reduce_scatter 0.262 GB/s @ 1 MiB"
    )
    assert "stopped early: the 10 s budget ran out with 2 of 6 measurements left" in line


def test_nccl_watchdog_env_without_nccl_defaults_to_the_checkpoint_dir():
    added = watchdog.nccl_env({}, "/ckpt")
    assert added == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/ckpt/.watchdog/nccl_trace_rank_",
    }


def test_nccl_watchdog_env_without_nccl_keeps_the_users_settings_and_dir():
    environ = {"KEEL_WATCHDOG_DIR": "/var/keel/fr", "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"}
    added = watchdog.nccl_env(environ, "/ckpt")
    assert added["TORCH_FR_DUMP_TEMP_FILE"] == "/var/keel/fr/nccl_trace_rank_"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in added
    environ = {"TORCH_FR_DUMP_TEMP_FILE": "/mine/trace_", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert set(watchdog.nccl_env(environ, "/ckpt")) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
    }
    # Nowhere to put dumps: torch's own default applies.
    assert "TORCH_FR_DUMP_TEMP_FILE" not in watchdog.nccl_env({}, None)


def test_start_barrier_message_names_the_missing_ranks_on_rank_zero():
    text = "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 2000 ms"
    assert watchdog.missing_ranks(text) == [1, 3]
    message = watchdog.start_barrier_message(0, 4, 2.0, text)
    assert message.startswith(
        "generation start: ranks 1, 3 did not reach the start barrier within 2 s "
        "(2/4 ranks arrived)"
    )
    assert "--startup-timeout-s" in message
    assert watchdog.start_barrier_message(
        0, 2, 300.0, "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 300000 ms"
    ).startswith("generation start: rank 1 did not reach")


def test_start_barrier_message_on_other_ranks_points_at_rank_zero():
    text = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18350"
    assert watchdog.missing_ranks(text) is None
    message = watchdog.start_barrier_message(2, 4, 5.0, text)
    assert message.startswith("generation start: rank 2 failed in the start barrier")
    assert "names the missing ranks in its own error" in message and text in message


def test_phase_timer_times_each_phase_since_the_previous_mark():
    timer = PhaseTimer(torch.device("cpu"))
    before = time.perf_counter()
    timer.start()
    time.sleep(0.01)
    timer.lap("data_s")
    time.sleep(0.02)
    timer.lap("compute_s")
    time.sleep(0.03)
    timer.lap("optimizer_s")
    elapsed = time.perf_counter() - before
    phases = timer.seconds()
    assert list(phases) == ["data_s", "compute_s", "optimizer_s"]
    # The sleeps bound each phase from below; nothing bounds one from above on a busy
    # machine, but the phases follow each other: together they fit in the time around.
    assert phases["data_s"] >= 0.01 and phases["compute_s"] >= 0.02
    assert phases["optimizer_s"] >= 0.03
    assert sum(phases.values()) <= elapsed


def test_health_flags_defaults_and_checked_deadlines(monkeypatch, capsys):
    monkeypatch.delenv("KEEL_PREFLIGHT", raising=False)
    args = train.parse_args(["--steps", "1"])
    assert (args.startup_timeout_s, args.collective_timeout_s) == (300.0, 60.0)
    assert (args.preflight, args.preflight_sizes_mb, args.preflight_budget_s) == (
        True,
        [1.0, 8.0],
        10.0,
    )
    assert train.parse_args(["--steps", "1", "--no-preflight"]).preflight is False
    assert train.parse_args(
        ["--steps", "1", "--preflight-sizes-mb", "0.5,4,64"]
    ).preflight_sizes_mb == [0.5, 4.0, 64.0]
    monkeypatch.setenv("KEEL_PREFLIGHT", "0")
    assert train.parse_args(["--steps", "1"]).preflight is False
    assert train.parse_args(["--steps", "1", "--preflight"]).preflight is True
    for argv, complaint in [
        (["--collective-timeout-s", "5"], "--collective-timeout-s 5 must exceed 7.5 s"),
        (
            ["--startup-timeout-s", "30"],
            "--startup-timeout-s 30 must be at least --collective-timeout-s (60)",
        ),
        (["--preflight-sizes-mb", "1,big"], "is not a comma-separated list of numbers"),
        (["--preflight-budget-s", "0"], "use --no-preflight"),
    ]:
        with pytest.raises(SystemExit):
            train.parse_args(["--steps", "1", *argv])
        assert complaint in capsys.readouterr().err
    monkeypatch.setenv("KEEL_PREFLIGHT", "no")
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "1"])
    assert "KEEL_PREFLIGHT='no' must be 0 (off) or 1 (on)" in capsys.readouterr().err


def test_checkpoint_due_at_the_schedule_the_last_step_and_on_request():
    args = train.parse_args(["--steps", "12", "--checkpoint-every", "5"])
    assert [step for step in range(1, 13) if train.checkpoint_due(step, args, False)] == [5, 10, 12]
    assert train.checkpoint_due(7, args, True)
