"""The planner's candidates for people and programs: a table, and JSON."""

from __future__ import annotations

from common.layout import AXES
from orchestrator.planner.ranking import Candidate
from orchestrator.planner.shapes import GB


def to_json(cands: list[Candidate]) -> list[dict]:
    """The candidates as JSON-ready dicts, in rank order (``rank`` starts at 1); memory in
    bytes, ``layout`` in ``KEEL_MESH`` form plus each axis."""
    out = []
    for rank, c in enumerate(cands, 1):
        mem = c.memory
        out.append(
            {
                "rank": rank,
                "layout": str(c.layout),
                **{axis: getattr(c.layout, axis) for axis in AXES},
                "zero_stage": c.zero_stage,
                "memory": {
                    "weights_bytes": mem.weights_bytes,
                    "gradients_bytes": mem.gradients_bytes,
                    "optimizer_bytes": mem.optimizer_bytes,
                    "activations_bytes": mem.activations_bytes,
                    "buffers_bytes": mem.buffers_bytes,
                    "headroom_bytes": mem.headroom_bytes,
                    "total_bytes": mem.total_bytes,
                },
                "comm_bytes_per_step": c.comm_bytes_per_step,
                "bubble": c.bubble,
                "fits": c.fits,
                "reason": c.reason,
            }
        )
    return out


_COLUMNS = (
    "rank",
    "layout",
    "ZeRO",
    "weights",
    "grads",
    "optim",
    "activ",
    "buffers",
    "headroom",
    "total",
    "comm GB/step",
    "bubble %",
    "fits",
    "reason",
)


def table(cands: list[Candidate]) -> str:
    """A fixed-width table of the candidates in rank order: memory per GPU and
    communication per step in GB (1e9 bytes, one decimal), bubble in percent."""
    rows = []
    for rank, c in enumerate(cands, 1):
        mem = c.memory
        gb = [
            f"{x / GB:,.1f}"
            for x in (
                mem.weights_bytes,
                mem.gradients_bytes,
                mem.optimizer_bytes,
                mem.activations_bytes,
                mem.buffers_bytes,
                mem.headroom_bytes,
                mem.total_bytes,
                c.comm_bytes_per_step,
            )
        ]
        rows.append(
            (
                str(rank),
                str(c.layout),
                str(c.zero_stage),
                *gb,
                f"{c.bubble * 100:.1f}",
                "yes" if c.fits else "no",
                c.reason,
            )
        )
    widths = [max(len(row[i]) for row in [_COLUMNS, *rows]) for i in range(len(_COLUMNS) - 1)]
    lines = []
    for row in [_COLUMNS, *rows]:
        cells = [
            cell.ljust(w) if i in (1, 12) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells + [row[-1]]))
    if not rows:
        lines.append("(no valid layout)")
    return "\n".join(lines)
