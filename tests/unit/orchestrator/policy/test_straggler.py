"""The straggler detector on synthetic step-time series: 4 ranks on 2 nodes (ranks 0, 1
on node-0; 2, 3 on node-1), 40 steps of 0.1 s, noise drawn from seeded generators."""

import random
import re
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from orchestrator.policy import straggler
from orchestrator.policy.straggler import (
    Flag,
    StepBlock,
    StepSample,
    StragglerConfig,
    evaluate,
    initial_state,
    score_window,
)

NODE = {0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"}
BASE_S = 0.1
STEPS = 40
CONFIG = StragglerConfig()
SEEDS = range(10)


def series(seed, noise, factor=lambda rank, step: 1.0, steps=STEPS):
    """Every rank's sample for every step: ``BASE_S x factor x (1 +- noise)``."""
    rng = random.Random(seed)
    return [
        StepSample(
            rank, NODE[rank], step, BASE_S * factor(rank, step) * rng.uniform(1 - noise, 1 + noise)
        )
        for step in range(1, steps + 1)
        for rank in NODE
    ]


def per_window(rank, ratios):
    """A factor that slows ``rank`` by ``ratios[i]`` in the i-th window of 5 steps."""
    return lambda r, step: ratios[(step - 1) // 5] if r == rank else 1.0


def run(samples, config=CONFIG):
    """Feeds the samples one step at a time, as the agents' batches arrive; returns the
    flags and the (step, node) of every clear."""
    state, flags, clears = initial_state(), [], []
    for step in sorted({s.step for s in samples}):
        state, new_flags, cleared = evaluate(state, [s for s in samples if s.step == step], config)
        flags += new_flags
        clears += [(state.last_step, node) for node in cleared]
    return flags, clears


SERIES = [
    ("uniform noise +-10% on all ranks", 0.10, lambda r, s: 1.0, None),
    (
        "rank 2 1.5x slower from step 10",
        0.05,
        lambda r, s: 1.5 if r == 2 and s >= 10 else 1.0,
        "node-1",
    ),
    ("all ranks 2x for steps 15-25", 0.10, lambda r, s: 2.0 if 15 <= s <= 25 else 1.0, None),
    (
        "rank 1 5x for one step at step 12",
        0.10,
        lambda r, s: 5.0 if r == 1 and s == 12 else 1.0,
        None,
    ),
]


@pytest.mark.parametrize(
    "name, noise, factor, flagged_node", SERIES, ids=[case[0] for case in SERIES]
)
def test_series(name, noise, factor, flagged_node):
    for seed in SEEDS:
        flags, clears = run(series(seed, noise, factor))
        assert [f.node for f in flags] == ([flagged_node] if flagged_node else []), (name, seed)
        assert clears == []
        for flag in flags:
            assert flag.slow_since_step == 11 and flag.flagged_at_step == 20, (name, seed, flag)
            assert flag.ratio > 1.35


def test_the_window_median_alone_absorbs_a_one_step_spike():
    spike = SERIES[3][2]
    for seed in SEEDS:
        assert run(series(seed, 0.10, spike), StragglerConfig(patience=1)) == ([], [])


def test_flag_names_the_node_the_window_the_streak_and_the_threshold():
    flags, _ = run(series(0, 0.0, per_window(2, [1, 1, 1.52, 1.52]), steps=20))
    assert flags == [
        Flag(
            "node-1",
            pytest.approx(1.52),
            11,
            20,
            "node-1 step time 1.52x the other nodes' median over steps 16-20 "
            "(slowest rank 2; 2 windows in a row since step 11, "
            "threshold 1.25x)",
        )
    ]


HYSTERESIS = [
    ("alternating 1.2x/1.3x windows never reach patience", [1.3, 1.2] * 4, [], []),
    (
        "flagged once, then hovering between recover and slowdown stays flagged",
        [1.3, 1.3] + [1.2, 1.3] * 3,
        [10],
        [],
    ),
    ("a slow node is flagged once, not every window", [1.5] * 8, [10], []),
    (
        "recovers to 1.0x: cleared after patience windows, flagged again later",
        [1.0, 1.5, 1.5, 1.0, 1.0, 1.5, 1.5, 1.0],
        [15, 35],
        [25],
    ),
    (
        "one fast window between slow ones does not clear",
        [1.5, 1.5, 1.0, 1.5, 1.0, 1.5, 1.0, 1.5],
        [10],
        [],
    ),
    ("recovering only to 1.2x does not clear", [1.5, 1.5, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2], [10], []),
]


@pytest.mark.parametrize(
    "name, ratios, flagged_at, cleared_at", HYSTERESIS, ids=[case[0] for case in HYSTERESIS]
)
def test_hysteresis(name, ratios, flagged_at, cleared_at):
    flags, clears = run(series(0, 0.0, per_window(2, ratios)))
    assert [f.flagged_at_step for f in flags] == flagged_at, name
    assert {f.node for f in flags} <= {"node-1"}
    assert clears == [(step, "node-1") for step in cleared_at], name


def test_patience_counts_in_windows_both_ways():
    config = StragglerConfig(patience=3)
    flags, clears = run(series(0, 0.0, per_window(2, [1.5, 1.5, 1.5, 1.0, 1.0, 1.0, 1, 1])), config)
    assert [f.flagged_at_step for f in flags] == [15]
    assert clears == [(30, "node-1")]


def test_arrival_order_and_repeats_do_not_change_the_flags():
    samples = series(3, 0.05, per_window(2, [1.0, 1.5, 1.5, 1.0, 1.0, 1.5, 1.5, 1.0]))
    expected = run(samples)
    assert [f.flagged_at_step for f in expected[0]] == [15, 35]

    # Everything at once, shuffled and twice over.
    shuffled = samples * 2
    random.Random(1).shuffle(shuffled)
    state, flags, cleared = evaluate(initial_state(), shuffled, CONFIG)
    assert flags == expected[0] and cleared == ["node-1"]
    assert state.last_step == STEPS and state.pending == ()

    # In batches of 7 steps, each shuffled, each sent twice, each repeating the
    # previous batch (already evaluated steps must be ignored, not scored again).
    state, flags, clears, previous = initial_state(), [], [], []
    rng = random.Random(2)
    for start in range(1, STEPS + 1, 7):
        batch = [s for s in samples if start <= s.step < start + 7]
        arrived = batch * 2 + previous
        rng.shuffle(arrived)
        state, new_flags, cleared = evaluate(state, arrived, CONFIG)
        flags += new_flags
        clears += [(state.last_step, node) for node in cleared]
        previous = batch
    assert flags == expected[0]
    assert [node for _, node in clears] == [node for _, node in expected[1]]


def test_a_window_waits_for_every_rank_seen_and_closes_without_a_lost_report():
    samples = series(0, 0.0)
    first_two_windows = [s for s in samples if s.step <= 10]
    # Rank 3 has not sent steps 4-5 yet: window 1-5 stays open.
    early = [s for s in first_two_windows if not (s.rank == 3 and s.step >= 4)]
    state, _, _ = evaluate(initial_state(), [s for s in early if s.step <= 5], CONFIG)
    assert state.last_step == 0
    # Rank 3's step 4 is lost, but it reported later steps: waiting is futile.
    state, _, _ = evaluate(
        state, [s for s in first_two_windows if s.step > 5 or (s.rank == 3 and s.step == 5)], CONFIG
    )
    assert state.last_step == 10 and state.pending == ()
    # The lost report arriving late is older than what was evaluated: ignored.
    late = next(s for s in samples if s.rank == 3 and s.step == 4)
    assert evaluate(state, [late], CONFIG)[0] == state


def test_too_few_ranks_are_not_compared():
    lone = [s for s in series(0, 0.0, lambda r, s: 3.0) if s.rank == 0]
    state, flags, cleared = evaluate(initial_state(), lone, CONFIG)
    assert (flags, cleared) == ([], []) and state.last_step == STEPS
    config = StragglerConfig(min_ranks=5)
    assert run(series(0, 0.0, per_window(2, [1.5] * 8)), config) == ([], [])


def test_a_node_is_as_slow_as_its_slowest_rank():
    # Rank medians 0.1, 0.1 (node-0) and 0.15, 0.1 (node-1): node-1 is 1.5x node-0's
    # median through rank 2; node-0 is 0.1 / median(0.15, 0.1) = 0.8x node-1's.
    window = series(0, 0.0, lambda r, s: 1.5 if r == 2 else 1.0, steps=5)
    window[3:4] = [StepSample(3, "node-1", 1, 10.0)]  # one spike: the median ignores it
    node0, node1 = score_window(window)
    assert (node0.node, node0.ratio, node0.ranks) == ("node-0", pytest.approx(0.8), 2)
    assert (node1.node, node1.ratio, node1.ranks, node1.slowest_rank) == (
        "node-1",
        pytest.approx(1.5),
        2,
        2,
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recover=0.9), "recover=0.9: must be at least 1"),
        (dict(slowdown=1.1, recover=1.1), "slowdown=1.1 must be above recover=1.1"),
        (dict(slowdown=1.05), "e.g. slowdown=1.25 with recover=1.10"),
        (dict(window=0), "window=0: give at least 1 step"),
        (dict(patience=0), "patience=0: give at least 1 window"),
        (dict(min_ranks=1), "min_ranks=1: give at least 2"),
    ],
)
def test_config_validation_says_how_to_fix_it(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StragglerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(step=0, step_time_s=0.1), "steps are numbered from 1"),
        (dict(step=1, step_time_s=0.0), "report the positive seconds the step took"),
        (dict(step=1, step_time_s=float("nan")), "report the positive seconds"),
    ],
)
def test_step_sample_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepSample(rank=0, node="node-0", **kwargs)


def test_on_two_nodes_a_slow_node_is_measured_against_the_other_one():
    # With the cluster median a 1.5x node of two would score (1.5 / 1.25) = 1.2x.
    window = [StepSample(0, "node-0", step, 0.1) for step in range(1, 6)] + [
        StepSample(1, "node-1", step, 0.15) for step in range(1, 6)
    ]
    node0, node1 = score_window(window)
    assert node1.ratio == pytest.approx(1.5) and node0.ratio == pytest.approx(1 / 1.5)


def brute_force_scores(samples):
    """The definition, quadratic: each node's slowest rank median against the median of
    every other node's rank medians (all ranks when there is one node)."""
    import statistics

    times, node_of = {}, {}
    for s in samples:
        times.setdefault(s.rank, []).append(s.step_time_s)
        node_of[s.rank] = s.node
    medians = {r: statistics.median(v) for r, v in times.items()}
    scores = []
    for node in sorted(set(node_of.values())):
        mine = [r for r in sorted(medians) if node_of[r] == node]
        slowest = max(mine, key=lambda r: (medians[r], -r))
        others = [m for r, m in medians.items() if node_of[r] != node] or list(medians.values())
        scores.append((node, medians[slowest] / statistics.median(others), len(mine), slowest))
    return scores


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_scoring_is_the_definition_exactly(seed):
    rng = random.Random(seed)
    nodes = rng.randint(1, 9)
    samples = []
    for rank in range(nodes * rng.randint(1, 4)):
        for step in range(1, rng.randint(1, 5) + 1):
            # Few distinct values, so that ties between ranks and nodes are common.
            samples.append(
                StepSample(rank, f"n{rank % nodes}", step, rng.choice([0.1, 0.2, 0.25, 0.3, 1.0]))
            )
    fast = [(s.node, s.ratio, s.ranks, s.slowest_rank) for s in score_window(samples)]
    assert fast == brute_force_scores(samples)


@pytest.mark.parametrize("seed", range(60))
def test_a_uniform_window_scored_as_arrays_is_the_definition_exactly(seed):
    """Every node sent each step once for as many ranks (the usual window at scale, scored
    on arrays): the same floats, slowest ranks and order as the definition, with ties
    common and windows of odd and even length."""
    rng = random.Random(seed)
    nodes, width, steps = rng.randint(1, 9), rng.randint(1, 4), rng.randint(1, 6)
    ranks = list(range(nodes * width))
    rng.shuffle(ranks)  # a node's ranks need not be adjacent, nor in order
    samples = [
        StepSample(rank, f"n{node}", step, rng.choice([0.1, 0.2, 0.25, 0.3, 1.0]))
        for node in range(nodes)
        for step in range(1, steps + 1)
        for rank in ranks[node * width : (node + 1) * width]
    ]
    blocks = as_blocks(samples)
    rng.shuffle(blocks)
    by_node = straggler._by_node(blocks)
    assert straggler._regular(by_node) and straggler._uniform(by_node) == (steps, width)
    fast = [(s.node, s.ratio, s.ranks, s.slowest_rank) for s in straggler._score_uniform(by_node)]
    assert fast == brute_force_scores(samples)


def as_blocks(samples):
    """The samples as agents send them: a ``StepBlock`` per node and step."""
    grouped = {}
    for s in samples:
        ranks, times = grouped.setdefault((s.node, s.step), ([], []))
        ranks.append(s.rank)
        times.append(s.step_time_s)
    return [
        StepBlock(node, step, tuple(ranks), tuple(times))
        for (node, step), (ranks, times) in grouped.items()
    ]


def run_blocks(samples, config=CONFIG):
    state, flags, clears = initial_state(), [], []
    for step in sorted({s.step for s in samples}):
        state, new_flags, cleared = evaluate(
            state, as_blocks([s for s in samples if s.step == step]), config
        )
        flags += new_flags
        clears += [(state.last_step, node) for node in cleared]
    return flags, clears


@pytest.mark.parametrize(
    "name, noise, factor, flagged_node", SERIES, ids=[case[0] for case in SERIES]
)
def test_a_nodes_steps_in_blocks_decide_as_its_ranks_samples_do(name, noise, factor, flagged_node):
    for seed in SEEDS:
        samples = series(seed, noise, factor)
        assert run_blocks(samples) == run(samples), (name, seed)


@pytest.mark.parametrize("seed", range(30))
def test_blocks_with_lost_repeated_and_late_reports_decide_as_samples_do(seed):
    """Windows that are not regular (a rank's report lost, a step sent twice, blocks of
    a node that differ in ranks, arriving out of order) are scored report by report:
    the same states and flags as the same reports sent one per rank."""
    rng = random.Random(seed)
    config = StragglerConfig(window=rng.randint(1, 5), patience=rng.randint(1, 2))
    slow = {rank: rng.choice([1.0, 1.0, 1.6]) for rank in NODE}
    samples = []
    for step in range(1, 31):
        for rank in NODE:
            if rng.random() < 0.05:
                continue  # lost
            sample = StepSample(rank, NODE[rank], step, BASE_S * slow[rank] * rng.uniform(0.9, 1.1))
            samples.append(sample)
            if rng.random() < 0.05:
                samples.append(sample._replace(step_time_s=sample.step_time_s * 3))  # repeat
    by_samples, by_blocks = initial_state(), initial_state()
    start = 0
    while start < len(samples):
        chunk = samples[start : start + rng.randint(1, 12)]
        start += len(chunk)
        rng.shuffle(chunk)
        by_samples, flags_s, cleared_s = evaluate(by_samples, chunk, config)
        by_blocks, flags_b, cleared_b = evaluate(by_blocks, as_blocks(chunk), config)
        assert (flags_b, cleared_b) == (flags_s, cleared_s)
        assert (by_blocks.last_step, by_blocks.streaks, by_blocks.flagged, by_blocks.scores) == (
            by_samples.last_step,
            by_samples.streaks,
            by_samples.flagged,
            by_samples.scores,
        )


@pytest.mark.parametrize("form", ["samples", "blocks"])
def test_a_step_sent_again_counts_as_first_sent(form):
    """Every step of rank 2 arrives twice, the second time 10x slower (a replay after a
    reconnect, say): the first report of each step is the one scored."""
    config = StragglerConfig(patience=1)
    first = series(0, 0.0, steps=5)
    again = [s._replace(step_time_s=s.step_time_s * 10) for s in first if s.rank == 2]
    batches = [first, again] if form == "samples" else [as_blocks(first), as_blocks(again)]
    state, flags, _ = evaluate(initial_state(), batches[0], config)
    assert state.last_step == 5 and flags == []
    state, flags, _ = evaluate(initial_state(), batches[0] + batches[1], config)
    assert state.last_step == 5 and flags == []
    assert [round(s.ratio, 6) for s in state.scores] == [1.0, 1.0]


# Few distinct values, so that ties between ranks and nodes are common, and any others.
STEP_TIME_S = st.sampled_from([0.1, 0.2, 0.25, 0.3, 1.0]) | st.floats(0.001, 10.0)


@st.composite
def windows(draw, uniform):
    """``(size, blocks)``: one window of ``size`` steps as ``StepBlock``s in arrival order.
    ``uniform``: every node sends each step once for as many ranks, as ``_score_uniform``
    takes them; otherwise nodes differ in ranks, and reports may be lost, sent twice,
    carry a rank of another node or list a node's ranks in another order."""
    size = draw(st.integers(1, 6))
    widths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    if uniform:
        widths = [widths[0]] * len(widths)
    ranks = draw(st.permutations(range(sum(widths))))
    ranks_of = [tuple(ranks[sum(widths[:n]) : sum(widths[: n + 1])]) for n in range(len(widths))]
    blocks = []
    for step in range(1, size + 1):
        for node, mine in enumerate(ranks_of):
            kind = "whole" if uniform else draw(st.sampled_from(KINDS))
            if kind == "lost":
                continue
            if kind == "subset":
                mine = tuple(draw(st.permutations(mine)))[: draw(st.integers(1, len(mine)))]
            if kind == "stray":
                mine = mine + (draw(st.sampled_from(ranks)),)
            times = tuple(draw(STEP_TIME_S) for _ in mine)
            blocks.append(StepBlock(f"n{node}", step, mine, times))
            if kind == "twice":
                blocks.append(StepBlock(f"n{node}", step, mine, tuple(t * 3 for t in times)))
    return size, draw(st.permutations(blocks))


KINDS = ["whole", "whole", "whole", "subset", "lost", "twice", "stray"]


@settings(max_examples=150, deadline=None)
@given(window=windows(uniform=True))
def test_a_uniform_window_on_arrays_scores_as_the_rule(window):
    """``_score_uniform``, the array form, gives the rule's floats and slowest ranks."""
    _, blocks = window
    by_node = straggler._by_node(blocks)
    assert straggler._regular(by_node) and straggler._uniform(by_node) is not None
    assert straggler._score_uniform(by_node) == score_window(blocks)


@settings(max_examples=150, deadline=None)
@given(window=windows(uniform=False) | windows(uniform=True))
def test_any_window_from_sorted_medians_scores_as_the_rule(window):
    """``_score_sorted``, the form for any window, gives the rule's floats and slowest
    ranks from the rank times ``_rank_times`` gathers, regular window or not."""
    _, blocks = window
    by_node = straggler._by_node(blocks)
    times, node_of = straggler._rank_times(blocks, by_node, straggler._regular(by_node))
    medians = {rank: statistics.median(values) for rank, values in times.items()}
    assert straggler._score_sorted(medians, node_of) == score_window(blocks)


@settings(max_examples=150, deadline=None)
@given(window=windows(uniform=False) | windows(uniform=True), data=st.data())
def test_evaluate_scores_a_window_as_the_rule(window, data):
    """``evaluate`` scores a window with whichever fast form applies, and the scores it
    keeps are the rule's. Each rank's report of the next step closes the window (a step
    it lost there is not waited for); windows of one step are left out, as their next
    window would close and be scored too."""
    size, blocks = window
    ranks = sorted({rank for block in blocks for rank in block.ranks})
    assume(size > 1 and ranks)
    closing = [StepSample(rank, "n0", size + 1, 0.1) for rank in ranks]
    arrived = data.draw(st.permutations(blocks + closing))
    state, _, _ = evaluate(initial_state(), arrived, StragglerConfig(window=size))
    assert state.last_step == size
    window_reports = [report for report in arrived if report.step <= size]
    assert state.scores == (tuple(score_window(window_reports)) if len(ranks) >= 2 else ())
