"""The parallel layout: ranks along each axis of the ``dp_replicate × dp_shard × tp × pp``
device mesh, its text form (``KEEL_MESH``, ``--layout``, a job spec's ``mesh``), and
which rank sits where. Pure, stdlib only: the controller, the CLI and the trainer all
read layouts with this one grammar.

Text: ``NAME=SIZE`` pairs joined by commas, axes in any order, omitted axes 1, e.g.
``dp_shard=4,tp=2``. ``str()`` gives the canonical form: the axes above 1 in the order
of ``AXES`` (``dp_shard=1`` for a single rank).

Rank order: ``pp`` outermost, then ``dp_replicate``, ``dp_shard``, and ``tp`` innermost
(torchtitan's order), so a tensor-parallel group is consecutive ranks, which torchrun's
node-major numbering puts on one node::

    rank = ((pp · R + dp_replicate) · S + dp_shard) · T + tp
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp_replicate", "dp_shard", "tp", "pp")
# Outermost first: the order of the device mesh's dimensions.
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A layout that cannot be read or cannot run; the message says how to fix it."""


def parse_axes(
    text: str | None, world_size: int | None = None, source: str | None = None
) -> dict[str, int]:
    """The axes named in ``text``, in the order given (``{"dp_shard": 2, "tp": 2}``).

    With ``world_size``, empty text means ``dp_shard`` over every rank and the sizes
    must multiply to it; without, empty text is an error. ``source`` names where the
    text came from (``KEEL_MESH``, ``--layout``) in error messages."""
    what = f"{source}={text!r}" if source else f"layout {text!r}"
    if not text or not text.strip():
        if world_size is not None:
            return {"dp_shard": world_size}
        raise LayoutError(
            "empty layout: write it as NAME=SIZE pairs joined by commas, "
            "e.g. 'dp_shard=8' or 'dp_shard=4,tp=2'"
        )
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        name, size = name.strip(), size.strip()
        if not sep or name not in AXES or not size.isdigit() or int(size) < 1:
            example = f"dp_shard={world_size}" if world_size else "dp_shard=4,tp=2"
            raise LayoutError(
                f"{what}: {part.strip()!r} is not NAME=SIZE with NAME one of "
                f"{', '.join(AXES)} and SIZE a positive integer, e.g. "
                f"{example!r}"
            )
        if name in axes:
            raise LayoutError(f"{what} gives {name} twice; give each axis once")
        axes[name] = int(size)
    if world_size is not None:
        product = 1
        for size in axes.values():
            product *= size
        if product != world_size:
            raise LayoutError(
                f"{what} spans {product} ranks but WORLD_SIZE={world_size}; "
                f"make the sizes multiply to the world size"
            )
    return axes


@dataclass(frozen=True)
class Layout:
    """Ranks along each mesh axis; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        bad = [f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) < 1]
        if bad:
            raise LayoutError(
                f"Layout {', '.join(bad)}: every axis is a positive integer; "
                f"use 1 for an axis that is not split"
            )

    @classmethod
    def parse(
        cls, text: str | None, world_size: int | None = None, source: str | None = None
    ) -> Layout:
        """The layout ``text`` describes (see ``parse_axes``)."""
        return cls(**parse_axes(text, world_size, source))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks, dp_replicate × dp_shard: groups that read different samples."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        coordinates = {}
        for name in reversed(MESH_DIM_NAMES):
            size = getattr(self, name)
            coordinates[name] = rank % size
            rank //= size
        return coordinates

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` reads: its ``tp`` and ``pp`` peers
        read the same samples."""
        coordinates = self.coordinates(rank)
        return coordinates["dp_replicate"] * self.dp_shard + coordinates["dp_shard"]

    def speaks_for_its_data(self, rank: int) -> bool:
        """Whether ``rank`` is the one of its data-parallel rank's tensor and pipeline
        peers (the one with tp and pp index 0) whose consumed samples are recorded."""
        coordinates = self.coordinates(rank)
        return coordinates["tp"] == 0 and coordinates["pp"] == 0

    def __str__(self) -> str:
        split = [f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1]
        return ",".join(split) or "dp_shard=1"
