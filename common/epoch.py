"""Epochs: what keeps fencing tokens growing across a restore of etcd from a snapshot.

Fencing rests on two tokens that only grow (docs/architecture.md, "Fencing"): a
leader's *term*, the etcd revision at which its leader key was created, and a job's
*generation*, a number the controller gives each incarnation of the job. Restoring
etcd from a snapshot winds both back to what the snapshot holds, while agents remember
higher terms and checkpoint fences name higher generations: every new leader would be
refused and every new rank 0 would be ``Superseded``.

The *epoch* (``/keel/epoch``, ``common.records.EpochRecord``; 0 while absent) counts
restores; ``keel restore-epoch`` advances it in the restored etcd before any controller
starts. A controller reads it when it takes the lead and

- sends it, with its term, on every message: agents compare ``(epoch, term)``
  lexicographically (``current``), so a leader of a later epoch wins even with a lower
  term. Terms are revisions that etcd chooses: only a pair can order them across a
  restore.
- numbers the generations it starts in epoch ``e`` from ``first_generation(e)``
  (``next_generation``): ``e × GENERATIONS_PER_EPOCH + 1`` onward. Generations are
  numbers Keel chooses, so it chooses them larger: every plain comparison of
  generations (checkpoint fences, adoption of running ranks, reports, manifests) then
  orders them exactly as ``(epoch, generation)`` would, with nothing about epochs in a
  fence file or on the wire, as long as a job goes through fewer than a million
  generations in one epoch.

Pure functions, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

# Generations of epoch e are e × this + 1 onward: a restart a minute for two years fits.
GENERATIONS_PER_EPOCH = 1_000_000


class Stamp(NamedTuple):
    """A fencing token with the epoch it counts in (``number``: a term or a generation).
    Tuples compare lexicographically: the epoch first, then the number."""

    epoch: int
    number: int

    def __str__(self) -> str:
        return f"{self.number} of epoch {self.epoch}"


def current(offered: Stamp, highest: Stamp) -> bool:
    """Whether a message stamped ``offered`` may be acted on by a receiver whose highest
    stamp seen is ``highest``: it is not older (a later epoch wins whatever its number;
    in the same epoch, the number decides)."""
    return offered >= highest


def newest(seen: Stamp, offered: Stamp) -> Stamp:
    """The highest stamp once ``offered`` is seen too."""
    return max(seen, offered)


def first_generation(epoch: int) -> int:
    """The lowest generation number a controller of ``epoch`` gives."""
    return epoch * GENERATIONS_PER_EPOCH + 1


def next_generation(generation: int, epoch: int) -> int:
    """The number of the generation that follows ``generation`` (the job's latest, as
    etcd holds it) when the controller leads in ``epoch``: the next one, or the epoch's
    first if ``generation`` is of an earlier epoch (etcd was restored)."""
    return max(generation + 1, first_generation(epoch))


def advanced(previous: int, asked: int | None = None) -> int:
    """The epoch a restore moves to from ``previous`` (the restored etcd's): ``asked``
    if given, else the next one. Raises ValueError, saying why, for an ``asked`` that is
    not above ``previous`` (an epoch only grows)."""
    if asked is None:
        return previous + 1
    if asked <= previous:
        raise ValueError(
            f"--epoch {asked}: the restored etcd holds epoch {previous} already; give a "
            f"higher one (above every epoch this cluster used), or none for {previous + 1}"
        )
    return asked
