"""Which nodes are stragglers: a pure decision over per-rank step times.

Ranks report ``(rank, node, step, step_time_s)``, where ``step_time_s`` is the rank's
own compute time for the step, measured before it waits on its peers (after that wait
every rank looks as slow as the slowest). ``evaluate`` buffers reports until a window
of ``config.window`` steps is complete, scores every node against the median of the
other nodes' ranks over that window, and flags a node only after ``config.patience``
slow windows in a row; a flagged node is cleared only after as many windows below
``config.recover``.
No I/O, no clock reads: time here is counted in steps.

Windows lie on a fixed grid of steps, ``1..window``, ``window+1..2*window``, ..., so
that the same reports give the same windows whatever order they arrive in. The state
belongs to one generation: a rank that stops reporting holds every later window open,
so the controller starts from ``initial_state()`` when it starts a generation.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy


@dataclass(frozen=True)
class StragglerConfig:
    # 1.25x: a healthy cluster's per-rank step times spread by about +-10 % (data-dependent
    # work, kernel scheduling), so the slowest of them stays near 1.1/0.9 = 1.22x the
    # median; a throttling GPU, a failing link or a noisy neighbour shows 1.5x and more.
    slowdown: float = 1.25  # flag when node step time / the other nodes' median exceeds this
    # Clearing at a lower ratio than flagging is the hysteresis: a node hovering at the
    # threshold stays in one state instead of flapping between flagged and clear.
    recover: float = 1.10  # a flagged node is cleared only below this ratio
    # A rank's median over 5 steps ignores up to 2 spikes (a GC pause, a data stall).
    window: int = 5  # steps per evaluation
    patience: int = 2  # consecutive slow windows to flag, fast windows to clear
    # With 2 ranks the median is their mean: a rank must then run at
    # 2 x slowdown / (1 + slowdown) of its peer to be flagged (1.67x at 1.25).
    min_ranks: int = 2  # windows with fewer reporting ranks are not scored

    def __post_init__(self):
        if not self.recover >= 1:
            raise ValueError(
                f"recover={self.recover}: must be at least 1 (a node is "
                f"cleared when it runs below recover x the other nodes' median), "
                f"e.g. 1.10"
            )
        if not self.slowdown > self.recover:
            raise ValueError(
                f"slowdown={self.slowdown} must be above recover="
                f"{self.recover}, or a node could be flagged and cleared by "
                f"the same ratio; e.g. slowdown=1.25 with recover=1.10"
            )
        if self.window < 1:
            raise ValueError(
                f"window={self.window}: give at least 1 step per evaluation "
                f"(5 suppresses one-step spikes)"
            )
        if self.patience < 1:
            raise ValueError(
                f"patience={self.patience}: give at least 1 window "
                f"(2 keeps a single slow window from flagging a node)"
            )
        if self.min_ranks < 2:
            raise ValueError(
                f"min_ranks={self.min_ranks}: give at least 2; a single rank "
                f"has nothing to be compared against"
            )


class StepSample(collections.namedtuple("StepSample", "rank node step step_time_s")):
    """Rank ``rank`` on node ``node`` computed step ``step`` (numbered from 1) in
    ``step_time_s`` seconds, not counting the wait for its peers. A tuple: the
    controller makes one per rank per step."""

    __slots__ = ()

    def __new__(cls, rank: int, node: str, step: int, step_time_s: float):
        if step < 1:
            raise ValueError(f"step={step} of rank {rank}: steps are numbered from 1")
        if not (math.isfinite(step_time_s) and step_time_s > 0):
            raise ValueError(
                f"step_time_s={step_time_s} of rank {rank} at step {step}: "
                f"report the positive seconds the step took"
            )
        return super().__new__(cls, rank, node, step, step_time_s)


class StepBlock(collections.namedtuple("StepBlock", "node step ranks step_times")):
    """Ranks ``ranks`` on node ``node`` computed step ``step`` in ``step_times`` seconds
    (in the same order; each checked as a ``StepSample``'s is): a node's step in one
    tuple, as its agent sends it, so that the controller makes one per node per step
    rather than one per rank."""

    __slots__ = ()


@dataclass(frozen=True)
class NodeScore:
    """A node's slowest rank's median step time over one window, as a multiple of the
    median of the other nodes' ranks (``ratio``), from ``ranks`` of its ranks;
    ``slowest_rank`` is that rank."""

    node: str
    ratio: float
    ranks: int
    slowest_rank: int


@dataclass(frozen=True)
class NodeStreak:
    """How a node scored over the windows evaluated so far."""

    node: str
    slow_windows: int = 0  # consecutive windows above config.slowdown
    fast_windows: int = 0  # consecutive windows below config.recover while flagged
    slow_since_step: int = 0  # first step of the window that began the slow streak; 0 = none


@dataclass(frozen=True)
class StragglerState:
    """What ``evaluate`` carries from one call to the next; build it with ``initial_state``."""

    last_step: int = 0  # every window through this step is evaluated
    ranks: frozenset[int] = frozenset()  # every rank that reported so far
    pending: tuple[StepBlock, ...] = ()  # reports after last_step, as they arrived
    streaks: tuple[NodeStreak, ...] = ()  # by node name
    flagged: frozenset[str] = frozenset()
    scores: tuple[NodeScore, ...] = ()  # of the latest window scored, by node


@dataclass(frozen=True)
class Flag:
    """Node ``node`` ran ``ratio`` x the other nodes' median in the window ending at step
    ``flagged_at_step``, slow in every window since step ``slow_since_step``."""

    node: str
    ratio: float
    slow_since_step: int
    flagged_at_step: int
    reason: str


def initial_state() -> StragglerState:
    return StragglerState()


def score_window(samples: Iterable[StepSample]) -> list[NodeScore]:
    """Each node's score over the samples of one window, sorted by node: every rank's
    median step time, and per node the ratio of its slowest rank (a node is as slow as
    its slowest rank, since its peers wait for it) to the median of the ranks on the
    other nodes. Leaving the node out keeps a slow node from raising its own yardstick:
    on two nodes the cluster median would be the mean of the slow and the fast, and a
    1.5x node would score only 1.2x."""
    times: dict[int, list[float]] = {}
    node_of: dict[int, str] = {}
    for rank, node, _, seconds in samples:
        values = times.get(rank)
        if values is None:
            times[rank], node_of[rank] = [seconds], node
        else:
            values.append(seconds)
    return _score({rank: _median(values) for rank, values in times.items()}, node_of)


def _score(rank_median: dict[int, float], node_of: dict[int, str]) -> list[NodeScore]:
    """``score_window`` from each rank's median and node. O(R log R) for R ranks: the
    rank medians are sorted once, and each node's reference is read off that order by
    skipping positions that hold the node's own medians (O(its ranks log R): which of
    equal values are skipped does not change what is left)."""
    ordered = sorted(rank_median.values())
    by_node: dict[str, list[int]] = {}
    for rank in sorted(rank_median):
        by_node.setdefault(node_of[rank], []).append(rank)
    scores = []
    for node in sorted(by_node):
        slowest = max(by_node[node], key=lambda rank: (rank_median[rank], -rank))
        own, previous, position = [], None, 0
        for value in sorted(rank_median[rank] for rank in by_node[node]):
            # The first position holding ``value``, or the next one for a repeat of it.
            position = position + 1 if value == previous else bisect.bisect_left(ordered, value)
            own.append(position)
            previous = value
        reference = _median_without(ordered, own if len(own) < len(ordered) else [])
        scores.append(
            NodeScore(node, rank_median[slowest] / reference, len(by_node[node]), slowest)
        )
    return scores


def _median(values: Sequence[float]) -> float:
    """``statistics.median`` (the same float: the mean of the two middle values of an
    even count), without its generality: it is called once per rank per window."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _median_without(ordered: list[float], skipped: list[int]) -> float:
    """``statistics.median`` of ``ordered`` (sorted) without the positions ``skipped``
    (sorted), without building that list."""

    def nth(n: int) -> float:
        # The n-th (from 0) element left once the skipped positions are taken out.
        index = n
        for skip in skipped:
            if skip <= index:
                index += 1
            else:
                break
        return ordered[index]

    count = len(ordered) - len(skipped)
    middle = count // 2
    if count % 2:
        return nth(middle)
    return (nth(middle - 1) + nth(middle)) / 2


def evaluate(
    state: StragglerState, samples: Iterable[StepSample | StepBlock], config: StragglerConfig
) -> tuple[StragglerState, list[Flag], list[str]]:
    """Adds newly arrived ``samples`` (a rank's step, or a node's; any order; repeats
    and steps already evaluated are ignored) and evaluates every window that is now
    complete. Returns the new state, the flags raised in this call (a flagged node is
    not flagged again until it is cleared) and the nodes cleared in this call, in the
    order they happened."""
    size, last_step = config.window, state.last_step
    # What is not yet evaluated, by window on the grid (window i holds steps
    # i*size+1 .. (i+1)*size), as it arrived.
    windows: dict[int, list[StepBlock]] = {}
    newest: dict[tuple[int, ...], int] = {}  # a block's ranks -> their newest step
    for block in itertools.chain(state.pending, samples):
        if type(block) is StepSample:
            rank, node, step, seconds = block
            block = StepBlock(node, step, (rank,), (seconds,))
        step = block.step
        if step <= last_step:
            continue
        index = (step - 1) // size
        window = windows.get(index)
        if window is None:
            window = windows[index] = []
        window.append(block)
        if step > newest.get(block.ranks, 0):
            newest[block.ranks] = step
    latest: dict[int, int] = {}  # rank -> its newest step not yet evaluated
    for block_ranks, step in newest.items():
        for rank in block_ranks:
            if step > latest.get(rank, 0):
                latest[rank] = step
    ranks = state.ranks | latest.keys()
    streaks = {s.node: s for s in state.streaks}
    flagged = set(state.flagged)
    scores = state.scores
    flags: list[Flag] = []
    cleared: list[str] = []

    while windows:
        index = min(windows)
        first, last = index * size + 1, (index + 1) * size
        blocks = windows[index]
        by_node = _by_node(blocks)
        regular = _regular(by_node)
        shape = _uniform(by_node) if regular else None
        # The usual case at scale: every rank seen reported every step of the window,
        # each node once per step for the same number of ranks. Scored as arrays.
        uniform = shape is not None and shape[0] == size and len(by_node) * shape[1] == len(ranks)
        if uniform:
            reported = len(ranks)
        else:
            times, node_of = _rank_times(blocks, by_node, regular)
            # Complete when every rank seen so far is done with it: it reported all of
            # its steps, or a later one (then a missing one was lost, and waiting is
            # futile). (The first test is the usual case, at C speed.)
            if not (
                (times and len(times) == len(ranks) and min(map(len, times.values())) == size)
                or all(
                    len(times.get(rank, ())) == size or latest.get(rank, 0) > last for rank in ranks
                )
            ):
                break
            reported = len(times)
        del windows[index]
        last_step = last
        if reported < config.min_ranks:
            continue
        scores = tuple(
            _score_uniform(by_node)
            if uniform
            else _score({rank: _median(values) for rank, values in times.items()}, node_of)
        )
        for score in scores:
            streak = streaks.get(score.node)
            if streak is None:
                streak = NodeStreak(score.node)
            if score.node in flagged:
                if score.ratio < config.recover:
                    streak = replace(streak, fast_windows=streak.fast_windows + 1)
                    if streak.fast_windows >= config.patience:
                        streak = NodeStreak(score.node)
                        flagged.discard(score.node)
                        cleared.append(score.node)
                else:
                    streak = replace(streak, fast_windows=0)
            elif score.ratio > config.slowdown:
                streak = replace(
                    streak,
                    slow_windows=streak.slow_windows + 1,
                    slow_since_step=streak.slow_since_step or first,
                )
                if streak.slow_windows >= config.patience:
                    flagged.add(score.node)
                    flags.append(_flag(score, streak, first, last, config))
            elif streak.slow_windows or streak.fast_windows or streak.slow_since_step:
                streak = NodeStreak(score.node)
            streaks[score.node] = streak

    new_state = StragglerState(
        last_step=last_step,
        ranks=frozenset(ranks),
        pending=tuple(block for index in sorted(windows) for block in windows[index]),
        streaks=tuple(streaks[node] for node in sorted(streaks)),
        flagged=frozenset(flagged),
        scores=scores,
    )
    return new_state, flags, cleared


def _by_node(blocks: list[StepBlock]) -> dict[str, list[StepBlock]]:
    """A window's blocks by node, each node's in arrival order."""
    by_node: dict[str, list[StepBlock]] = {}
    for block in blocks:
        mine = by_node.get(block.node)
        if mine is None:
            by_node[block.node] = [block]
        else:
            mine.append(block)
    return by_node


def _regular(by_node: dict[str, list[StepBlock]]) -> bool:
    """Whether every node sent each of its steps once, for the same ranks, and no rank
    is reported twice (by two nodes, or twice in a block)."""
    if sum(len(mine[0].ranks) for mine in by_node.values()) != len(
        set().union(*(mine[0].ranks for mine in by_node.values()))
    ):
        return False
    for mine in by_node.values():
        ranks = mine[0].ranks
        if not (
            all(block.ranks == ranks for block in mine)
            and len({block.step for block in mine}) == len(mine)
        ):
            return False
    return True


def _uniform(by_node: dict[str, list[StepBlock]]) -> tuple[int, int] | None:
    """(steps, ranks) of each node of a regular window (``_regular``), when every node
    sent the same number of steps for the same number of ranks; else None."""
    first = next(iter(by_node.values()), None)
    if first is None:
        return None
    steps, width = len(first), len(first[0].ranks)
    if not all(len(mine) == steps and len(mine[0].ranks) == width for mine in by_node.values()):
        return None
    return steps, width


def _rank_times(
    blocks: list[StepBlock], by_node: dict[str, list[StepBlock]], regular: bool
) -> tuple[dict[int, Sequence[float]], dict[int, str]]:
    """Each rank's step times in a window (the first report of each of its steps counts)
    and its node (of its first report); ``by_node`` is ``_by_node(blocks)``, ``regular``
    ``_regular(by_node)``. In a regular window a node's ranks' times are its blocks'
    columns, transposed at C speed; otherwise report by report, in arrival order."""
    times: dict[int, Sequence[float]] = {}
    node_of: dict[int, str] = {}
    if regular:
        for node, mine in by_node.items():
            for rank, column in zip(mine[0].ranks, zip(*(block.step_times for block in mine))):
                times[rank], node_of[rank] = column, node
        return times, node_of
    steps_of: dict[int, dict[int, float]] = {}
    for node, step, ranks, seconds in blocks:
        for rank, value in zip(ranks, seconds):
            steps = steps_of.get(rank)
            if steps is None:
                steps_of[rank], node_of[rank] = {step: value}, node
            elif step not in steps:
                steps[step] = value
    return {rank: list(steps.values()) for rank, steps in steps_of.items()}, node_of


def _score_uniform(by_node: dict[str, list[StepBlock]]) -> list[NodeScore]:
    """``_score`` of a uniform window (``_uniform``), computed on arrays: the same
    floats (a median of an even count is the mean of its two middle values, as
    ``_median``'s; the ratio one division), a few times faster at thousands of nodes.
    Each node's reference is the median of the sorted rank medians without the node's
    own positions, found as ``_score`` finds them."""
    names = sorted(by_node)
    steps, width = len(by_node[names[0]]), len(by_node[names[0]][0].ranks)
    count = len(names)
    flat = numpy.fromiter(
        itertools.chain.from_iterable(
            block.step_times for name in names for block in by_node[name]
        ),
        float,
        count=count * steps * width,
    )
    medians = numpy.median(flat.reshape(count, steps, width), axis=1)  # node x rank
    ranks = numpy.array([by_node[name][0].ranks for name in names], dtype=numpy.int64)
    top = medians.max(axis=1)
    # The slowest rank: the highest median, the lowest rank of those that tie.
    slowest = numpy.where(medians == top[:, None], ranks, numpy.iinfo(numpy.int64).max).min(axis=1)
    ordered = numpy.sort(medians, axis=None)
    own = numpy.sort(medians, axis=1)
    # The first position holding each value, or the next one for a repeat of it.
    skipped = numpy.searchsorted(ordered, own, "left")
    for column in range(1, width):
        repeat = own[:, column] == own[:, column - 1]
        skipped[:, column] = numpy.where(repeat, skipped[:, column - 1] + 1, skipped[:, column])
    if width >= ordered.size:  # one node: its reference is its own ranks
        skipped = skipped[:, :0]
    left = ordered.size - skipped.shape[1]

    def nth(n: int) -> numpy.ndarray:
        # The n-th (from 0) element left once each node's skipped positions are out.
        index = numpy.full(count, n)
        for column in range(skipped.shape[1]):
            index += skipped[:, column] <= index
        return ordered[index]

    middle = left // 2
    reference = nth(middle) if left % 2 else (nth(middle - 1) + nth(middle)) / 2
    return [
        NodeScore(name, ratio, width, rank)
        for name, ratio, rank in zip(names, (top / reference).tolist(), slowest.tolist())
    ]


def _flag(
    score: NodeScore, streak: NodeStreak, first: int, last: int, config: StragglerConfig
) -> Flag:
    windows = "1 window" if streak.slow_windows == 1 else f"{streak.slow_windows} windows in a row"
    reason = (
        f"{score.node} step time {score.ratio:.2f}x the other nodes' median over steps "
        f"{first}-{last} (slowest rank {score.slowest_rank}; {windows} since step "
        f"{streak.slow_since_step}, threshold {config.slowdown:g}x)"
    )
    return Flag(score.node, score.ratio, streak.slow_since_step, last, reason)
