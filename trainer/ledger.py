"""The data ledger: which global samples each optimizer step of the committed lineage
trained on, so that exactly-once consumption can be proved rather than assumed.

Every step, each data-parallel rank's actual ``(first sample, count)`` is gathered and
recorded as ``[step, first_sample, count]`` ranges (contiguous ranges of one step
merged). The ledger is saved and restored with the checkpoint, so the steps a failed
generation ran after its last checkpoint drop out of the lineage with it. At each
commit rank 0 also writes it into the checkpoint directory as ``ledger.json``::

    {"global_batch": B, "step": N, "ranges": [[step, first_sample, count], ...]}

``B`` is the global batch of the run that wrote it, ``N`` the checkpoint's step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

LEDGER_FILE = "ledger.json"


def merge(step: int, consumed: Iterable[tuple[int, int]]) -> list[list[int]]:
    """The ranges of step ``step`` from every rank's ``(first, count)``, sorted and with
    touching ranges joined; empty ones dropped. Overlaps are kept as they are, so
    duplicates stay visible."""
    merged: list[list[int]] = []
    for first, count in sorted(consumed):
        if count <= 0:
            continue
        if merged and merged[-1][1] + merged[-1][2] == first:
            merged[-1][2] += count
        else:
            merged.append([step, first, count])
    return merged


class Ledger:
    """The lineage's ranges, in step order. ``ranges``: ``[[step, first_sample,
    count], ...]``, plain lists of ints (what DCP stores and ``ledger.json`` holds)."""

    def __init__(self, ranges: list[list[int]] | None = None) -> None:
        self.ranges: list[list[int]] = [list(entry) for entry in ranges or []]

    def record(self, step: int, consumed: Iterable[tuple[int, int]]) -> None:
        """Adds what the data-parallel ranks consumed in step ``step``."""
        self.ranges.extend(merge(step, consumed))

    def document(self, global_batch: int, step: int) -> dict:
        """The ``ledger.json`` content of the checkpoint of step ``step``."""
        return {"global_batch": global_batch, "step": step, "ranges": self.ranges}

    def write(self, directory: str, global_batch: int, step: int) -> str:
        """Writes ``ledger.json`` into ``directory`` (not fsynced: the checkpoint commit
        fsyncs the whole directory) and returns its path."""
        path = os.path.join(directory, LEDGER_FILE)
        with open(path, "w") as out:
            json.dump(self.document(global_batch, step), out, separators=(",", ":"))
            out.write("\n")
        return path


def summarize(ranges: Iterable[Iterable[int]], expected_samples: int) -> dict[str, int]:
    """Checks ``[step, first_sample, count]`` ranges against samples ``[0,
    expected_samples)``. Returns ``expected`` (``expected_samples``), ``consumed`` (sum
    of counts: sample reads, repeats included), ``duplicates`` (reads of a sample after
    its first: a sample read three times counts 2) and ``missing`` (samples below
    ``expected_samples`` never read). Exactly once means ``consumed == expected`` and
    both others 0; when no range reaches past ``expected_samples``, ``consumed ==
    expected - missing + duplicates``. Pure; linear in the number of ranges after a
    sort, whatever their sizes."""
    delta: dict[int, int] = {0: 0, expected_samples: 0}
    consumed = 0
    for _, first, count in ranges:
        if count <= 0:
            continue
        consumed += count
        delta[first] = delta.get(first, 0) + 1
        delta[first + count] = delta.get(first + count, 0) - 1
    duplicates = missing = 0
    depth = 0
    positions = sorted(delta)
    for start, end in zip(positions, positions[1:]):
        depth += delta[start]
        if depth >= 2:
            duplicates += (depth - 1) * (end - start)
        elif depth == 0 and start < expected_samples:
            missing += min(end, expected_samples) - start
    return {"expected": expected_samples, "consumed": consumed, "duplicates": duplicates, "missing": missing}
