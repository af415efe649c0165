"""Preflight: before a generation's first step, every rank times all_reduce,
all_gather and reduce_scatter over the whole world at the job's bucket sizes, so a
slow link or a misconfigured network shows up as a figure on one node before it
shows up as a slow job.

Each measurement is a few warm-up calls, then the median of a few timed calls. The
sweep stops early, on every rank at the same point, once its time budget is spent;
the budget is checked between measurements, so it may overrun by one.

Bandwidths are those of nccl-tests (its doc/PERFORMANCE.md), so the figures compare
with theirs: ``algbw = S / t`` and ``busbw = algbw × 2(n−1)/n`` for all_reduce,
``× (n−1)/n`` for all_gather and reduce_scatter, where ``S`` is the all_reduce buffer,
the all_gather's whole output and the reduce_scatter's whole input, and ``n`` the
number of ranks. busbw is what each link carries, comparable across collectives and
world sizes against the hardware's peak.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.runtime import Collective

COLLECTIVES = tuple(Collective)
DEFAULT_SIZES_MB = (1.0, 8.0)
DEFAULT_BUDGET_S = 10.0
WARMUP_CALLS = 2
TIMED_CALLS = 5
MIB = 1 << 20
GB = 1e9
_DTYPE = torch.float32
_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class Result:
    """One measurement: ``collective`` over ``size_bytes`` (as nccl-tests counts them),
    ``time_s`` the median seconds per call, bandwidths in GB/s (1e9 bytes)."""

    collective: Collective
    size_bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass(frozen=True)
class Sweep:
    """This rank's ``results``, the sweep's ``wall_s`` seconds, and how many
    measurements were ``skipped`` because the budget ran out."""

    results: list[Result]
    wall_s: float
    skipped: int


def bus_bandwidth(
    collective: Collective, size_bytes: int, time_s: float, n: int
) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes per second) of ``collective`` moving
    ``size_bytes`` in ``time_s`` seconds over ``n`` ranks, as nccl-tests computes
    them. Pure."""
    factors = {
        Collective.ALL_REDUCE: 2 * (n - 1) / n,
        Collective.ALL_GATHER: (n - 1) / n,
        Collective.REDUCE_SCATTER: (n - 1) / n,
    }
    if collective not in factors:
        raise ValueError(
            f"unknown collective {collective!r}; one of {', '.join(c.value for c in COLLECTIVES)}"
        )
    algbw = size_bytes / time_s / GB
    return algbw, algbw * factors[collective]


def sizes_bytes(sizes_mb: Sequence[float], n: int) -> list[int]:
    """Each size in MiB as bytes, rounded down to whole float32 elements per rank
    (at least one), so every rank's share of an all_gather or reduce_scatter is equal."""
    unit = _ELEMENT_BYTES * n
    return [max(1, int(size * MIB) // unit) * unit for size in sizes_mb]


def run(sizes_mb: Sequence[float], budget_s: float, device: torch.device) -> Sweep:
    """Measures every collective at every size (in MiB), smaller sizes first, over the
    default process group. Stops early, on all ranks alike, once ``budget_s`` seconds
    have passed on the slowest rank. Collective."""
    n = dist.get_world_size()
    started = time.perf_counter()
    cells = [(size, collective) for size in sizes_bytes(sizes_mb, n) for collective in COLLECTIVES]
    results: list[Result] = []
    for index, (size, collective) in enumerate(cells):
        if _slowest_elapsed(time.perf_counter() - started, device) >= budget_s:
            return Sweep(results, time.perf_counter() - started, skipped=len(cells) - index)
        call = _collective(collective, size, n, device)
        for _ in range(WARMUP_CALLS):
            _timed(call, device)
        time_s = statistics.median(_timed(call, device) for _ in range(TIMED_CALLS))
        results.append(
            Result(collective, size, time_s, *bus_bandwidth(collective, size, time_s, n))
        )
    return Sweep(results, time.perf_counter() - started, skipped=0)


def summary(sweep: Sweep, world_size: int, budget_s: float) -> str:
    """One line for the log: busbw per collective at each size."""
    parts = []
    for collective in COLLECTIVES:
        figures = [
            f"{r.busbw_gbps:.3g} GB/s @ {r.size_bytes / MIB:.3g} MiB"
            for r in sweep.results
            if r.collective == collective
        ]
        if figures:
            parts.append(f"{collective.value} {', '.join(figures)}")
    line = (
        f"preflight over {world_size} ranks in {sweep.wall_s:.2f} s, "
        f"busbw: {'; '.join(parts) or 'nothing measured'}"
    )
    if sweep.skipped:
        line += (
            f" (stopped early: the {budget_s:g} s budget ran out with {sweep.skipped} of "
            f"{sweep.skipped + len(sweep.results)} measurements left; raise --preflight-budget-s)"
        )
    return line


def _slowest_elapsed(elapsed_s: float, device: torch.device) -> float:
    # Every rank must stop at the same measurement, or the ones that go on would wait
    # for the others forever; the slowest rank's clock decides for all.
    elapsed = torch.tensor([elapsed_s], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _collective(
    collective: Collective, size: int, n: int, device: torch.device
) -> Callable[[], None]:
    """A call of ``collective`` on buffers of ``size`` bytes as nccl-tests counts them."""
    whole = torch.zeros(size // _ELEMENT_BYTES, dtype=_DTYPE, device=device)
    share = torch.zeros(size // _ELEMENT_BYTES // n, dtype=_DTYPE, device=device)
    if collective is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(whole)
    if collective is Collective.ALL_GATHER:
        return lambda: dist.all_gather_single(whole, share)
    return lambda: dist.reduce_scatter_single(share, whole)


def _timed(call: Callable[[], None], device: torch.device) -> float:
    _synchronize(device)
    started = time.perf_counter()
    call()
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
