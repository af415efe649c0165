"""Wall time of the phases of one training step (reading the batch, forward and
backward, the optimizer), for the step reports.

On CUDA a phase boundary is a CUDA event rather than a clock read: kernels run
asynchronously, and a clock read would time their launch, not their execution. The
events are read after the step has synchronized anyway (its loss is copied to the
host, or its all-gathered results), so timing adds no synchronization of its own.
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """Times consecutive phases of a step: ``start()`` when the step starts, then
    ``lap(name)`` as each phase ends; ``seconds()`` once the step's results were read
    back to the host."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def start(self) -> None:
        self._marks = [("", self._now())]

    def lap(self, name: str) -> None:
        """Ends phase ``name``, which began at the previous mark."""
        self._marks.append((name, self._now()))

    def seconds(self) -> dict[str, float]:
        """Phase name → seconds, for the phases lapped since ``start()``."""
        if self._cuda:
            # Returns at once when the step has synchronized already, as it normally has.
            self._marks[-1][1].synchronize()
        return {
            name: begin.elapsed_time(end) / 1000 if self._cuda else end - begin
            for (_, begin), (name, end) in zip(self._marks, self._marks[1:])
        }

    def _now(self) -> object:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
