from orchestrator.policy.diagnosis import culprit, summarize, waiting_in_collective
from orchestrator.policy.guardrails import replacement_allowed, restart_backoff_s, should_cordon

HUNG = (
    "time.sleep in inject_faults (trainer/runtime.py:312)\n"
    "Thread 0x00007f01 (most recent call first):\n"
    '  File "/x/trainer/runtime.py", line 312 in inject_faults\n'
    '  File "/x/trainer/train.py", line 250 in train\n'
)
WAITING = (
    "all_gather in exchange (trainer/train.py:140)\n"
    "Thread 0x00007f02 (most recent call first):\n"
    '  File "/x/torch/distributed/distributed_c10d.py", line 3900 in all_gather\n'
    '  File "/x/trainer/train.py", line 140 in exchange\n'
)


def verdicts(stacks: dict[int, str]) -> tuple[dict[int, str], dict[int, bool]]:
    return (
        {rank: stack.partition("\n")[0] for rank, stack in stacks.items()},
        {rank: waiting_in_collective(stack) for rank, stack in stacks.items()},
    )


def test_the_rank_outside_collectives_is_the_culprit():
    where, waiting = verdicts({0: WAITING, 1: HUNG, 2: WAITING})
    assert waiting == {0: True, 1: False, 2: True}
    assert culprit(waiting) == 1
    assert summarize(where, waiting) == (
        "rank 1 stopped in time.sleep in inject_faults "
        "(trainer/runtime.py:312); ranks 0, 2 waiting in "
        "collectives"
    )


def test_when_everyone_waits_the_culprit_is_elsewhere():
    where, waiting = verdicts({0: WAITING})
    assert culprit(waiting) is None
    assert summarize(where, waiting).startswith("every reporting rank was waiting")


def test_cordon_after_two_flags_within_an_hour():
    assert not should_cordon([100.0], now=200.0)
    assert should_cordon([100.0, 150.0], now=200.0)
    assert not should_cordon([100.0, 150.0], now=100.0 + 3700.0 + 50.0)


def test_replacements_are_capped_per_hour():
    assert replacement_allowed([], 0.0, per_hour=2)
    assert not replacement_allowed([10.0, 20.0], 30.0, per_hour=2)
    assert replacement_allowed([10.0, 20.0], 3700.0, per_hour=2)


def test_restart_backoff_doubles_and_is_capped():
    assert [restart_backoff_s(r) for r in range(6)] == [0.0, 0.0, 0.5, 1.0, 2.0, 4.0]
    assert restart_backoff_s(50) == 30.0


def test_preflight_flags_a_node_far_below_its_peers_once():
    from orchestrator.controller.job_health import JobHealth
    from orchestrator.policy.preflight import SLOW_REASON as PREFLIGHT_SLOW_REASON
    from orchestrator.spec.health import DEFAULTS
    from protos import keel_pb2

    def report(busbw):
        return keel_pb2.PreflightReport(
            results=[
                keel_pb2.CollectiveResult(
                    collective=keel_pb2.COLLECTIVE_ALL_REDUCE, size_bytes=1 << 20, busbw_gbps=busbw
                )
            ]
        )

    health = JobHealth("j", DEFAULTS)

    def flagged(node, busbw):
        health.add_preflight(node, report(busbw), step=0)
        return [(f.node, f.reason) for f in health.slow_flags()]

    assert flagged("node-0", 10.0) == []
    assert flagged("node-1", 9.0) == []
    assert flagged("node-2", 2.0) == [("node-2", PREFLIGHT_SLOW_REASON)]
    # A second rank of the same node keeps the node's slowest figure; no second flag.
    assert flagged("node-2", 8.0) == []
    status = {p.node: p for p in health.preflight_status()}
    assert status["node-2"].slow and not status["node-0"].slow
    assert status["node-2"].results[0].busbw_gbps == 2.0


def test_one_noisy_preflight_figure_does_not_make_a_node_slow():
    """Two nodes, four collectives and sizes: node-1 is far below on one of them (a
    busy host timing a small buffer), which is noise; far below on three, it is slow."""
    from orchestrator.controller.job_health import JobHealth
    from orchestrator.spec.health import DEFAULTS
    from protos import keel_pb2

    def report(*busbws):
        return keel_pb2.PreflightReport(
            results=[
                keel_pb2.CollectiveResult(
                    collective=keel_pb2.COLLECTIVE_ALL_REDUCE,
                    size_bytes=1 << (20 + i),
                    busbw_gbps=bw,
                )
                for i, bw in enumerate(busbws)
            ]
        )

    health = JobHealth("j", DEFAULTS)
    health.add_preflight("node-0", report(10, 10, 10, 10), step=0)
    health.add_preflight("node-1", report(1, 9, 10, 11), step=0)
    assert health.slow_flags() == [] and health.slow_preflight_nodes() == set()
    health.add_preflight("node-1", report(1, 1, 1, 11), step=0)  # its slowest rank
    assert [f.node for f in health.slow_flags()] == ["node-1"]


def test_only_failures_in_a_row_without_a_healthy_stretch_back_off():
    from orchestrator.policy.guardrails import HEALTHY_STRETCH_S, repeated_failures

    # The first failure restarts at once, however soon it came.
    assert repeated_failures(0, 5.0) == 1 and restart_backoff_s(1) == 0.0
    # A generation that died quickly, again and again, backs off more each time.
    assert repeated_failures(1, 5.0) == 2 and restart_backoff_s(2) == 0.5
    assert repeated_failures(2, 5.0) == 3 and restart_backoff_s(3) == 1.0
    # One that lived a healthy stretch before it failed starts a new row.
    assert repeated_failures(7, HEALTHY_STRETCH_S) == 1
