"""The preflight comparison: which nodes' collectives are far slower than their
peers'. Pure: the controller passes each node's slowest figures and flags the nodes
this names."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Hashable, Mapping

# A node whose bus bandwidth is below this share of the nodes' median is slow.
SLOW_SHARE = 0.5
SLOW_REASON = "preflight: collective bus bandwidth below half of its peers'"


def slow_nodes(busbw_gbps: Mapping[str, Mapping[Hashable, float]]) -> set[str]:
    """Nodes below SLOW_SHARE of the median on most of the collectives and sizes they
    were compared on. ``busbw_gbps``: node -> (collective, size) -> its slowest rank's
    bus bandwidth. A figure is compared only where at least two nodes have one; one
    noisy figure (a busy host, a small buffer timed once) does not make a node slow, a
    slow link does on all."""
    if len(busbw_gbps) < 2:
        return set()
    compared: collections.Counter = collections.Counter()
    below: collections.Counter = collections.Counter()
    measured = {k for figures in busbw_gbps.values() for k in figures}
    for key in measured:
        figures = {n: f[key] for n, f in busbw_gbps.items() if key in f}
        if len(figures) < 2:
            continue
        median = statistics.median(figures.values())
        compared.update(figures.keys())
        below.update(n for n, bw in figures.items() if bw < SLOW_SHARE * median)
    return {n for n, count in below.items() if count > compared[n] / 2}
