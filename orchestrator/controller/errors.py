"""How a reconcile step fails. ``Terminal``: the job cannot go on, and ends FAILED with
the reason. A write that lost to a concurrent one (``store.StaleRevision``) reloads the
job's state and is tried again at once. Anything else (etcd out of reach, a bug) is
tried again after a back-off that doubles up to ``RETRY_MAX_S``, and said once."""

from __future__ import annotations

RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0  # short: an etcd that is back should be used within a couple of ticks


class Terminal(Exception):
    """The job cannot go on; the message is the reason it ends FAILED with."""


def next_backoff_s(previous_s: float) -> float:
    """The wait before the next try after a failure: ``RETRY_FIRST_S``, doubling, at
    most ``RETRY_MAX_S``."""
    return min(RETRY_MAX_S, previous_s * 2) if previous_s else RETRY_FIRST_S
