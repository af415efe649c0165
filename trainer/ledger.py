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
        fsyncs it, with the directory) and returns its path."""
        path = os.path.join(directory, LEDGER_FILE)
        with open(path, "w") as out:
            json.dump(self.document(global_batch, step), out, separators=(",", ":"))
            out.write("\n")
        return path
