"""A recovery under way: the generation change after a fault, timed for the recovery
histograms (``metrics.recovered``). Wall-clock seconds throughout: its times are
compared with the ranks' step reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Recovery:
    """When the fault of ``cause`` happened and was detected, the old generation
    stopped (the job PENDING again) and the new one started (RUNNING); the new
    generation's first step ends it."""

    cause: str
    detected_at_unix: float
    fault_at_unix: float
    stopped_at_unix: float | None = None
    started_at_unix: float | None = None
