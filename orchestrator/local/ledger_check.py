"""An independent audit of a trainer's data ledger: was every sample consumed once?

The reference trainer writes ``ledger.json`` into every committed checkpoint:
``{"global_batch": B, "step": N, "ranges": [[step, first_sample, count], ...]}``, the
samples that the steps of the committed lineage actually trained on. `keel up` reads the
final checkpoint's ledger and reports the audit in its summary.
"""

from __future__ import annotations

import json
from pathlib import Path


def audit(ranges: list[list[int]], expected_samples: int) -> dict[str, int]:
    """Samples ``[0, expected_samples)`` against the consumed ``[step, first, count]``
    ranges: how many were consumed, consumed more than once, or never. Linear in the
    number of ranges (a sweep over their boundaries), not in the number of samples."""
    events: dict[int, int] = {}
    consumed = 0
    for _step, first, count in ranges:
        if count <= 0:
            continue
        consumed += count
        events[first] = events.get(first, 0) + 1
        events[first + count] = events.get(first + count, 0) - 1
    duplicates = covered = 0
    depth, previous = 0, 0
    for point in sorted(events):
        if depth > 0:
            span = point - previous
            duplicates += (depth - 1) * span
            # Only the part inside [0, expected) counts towards coverage.
            lo, hi = max(previous, 0), min(point, expected_samples)
            covered += max(0, hi - lo)
        depth += events[point]
        previous = point
    return {
        "expected": expected_samples,
        "consumed": consumed,
        "duplicates": duplicates,
        "missing": expected_samples - covered,
    }


def audit_checkpoint(checkpoint: Path) -> dict[str, int]:
    """Audit the ledger of a committed checkpoint: its steps should have consumed
    exactly the samples ``[0, step × global_batch)``."""
    ledger = json.loads((checkpoint / "ledger.json").read_text())
    return audit(ledger["ranges"], ledger["step"] * ledger["global_batch"])
