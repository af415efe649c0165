"""Guard rails on automatic remediation: cordoning repeat offenders, capping
replacements, backing off restarts. Pure; times are seconds on the caller's clock."""

from __future__ import annotations

from collections.abc import Sequence

HOUR_S = 3600.0
CORDON_AFTER_FLAGS = 2  # a node flagged this often within an hour is cordoned
MAX_BACKOFF_S = 30.0


def should_cordon(flag_times: Sequence[float], now: float) -> bool:
    """True when a node has been flagged ``CORDON_AFTER_FLAGS`` times in the last hour:
    replacing it again would only move the job back onto it later."""
    return sum(1 for t in flag_times if now - t <= HOUR_S) >= CORDON_AFTER_FLAGS


def replacement_allowed(replacement_times: Sequence[float], now: float, per_hour: int) -> bool:
    """False once ``per_hour`` replacements happened in the last hour: beyond that the
    cause is likelier the job or the cluster than one node, and a person should look."""
    return sum(1 for t in replacement_times if now - t <= HOUR_S) < per_hour


def restart_backoff_s(repeated: int) -> float:
    """Seconds to wait before restarting after ``repeated`` failures in a row
    (``repeated_failures``): none after the first, then 0.5 s doubling, capped at
    30 s."""
    if repeated <= 1:
        return 0.0
    return min(MAX_BACKOFF_S, 0.5 * 2 ** (repeated - 2))


# A generation that lived this long before it failed was healthy: its failure starts
# a new row, and the restart after it is not held back for the failures before.
HEALTHY_STRETCH_S = 60.0


def repeated_failures(previous: int, lived_s: float) -> int:
    """Failures in a row, this one included, after a generation that failed
    ``lived_s`` after it was placed: 1 when it had a healthy stretch, else one more
    than ``previous``."""
    return 1 if lived_s >= HEALTHY_STRETCH_S else previous + 1


# A reconcile that failed (etcd out of reach, a bug) is tried again after a back-off
# that starts here and doubles, up to RETRY_MAX_S: short, so that an etcd that is back
# is used within a couple of ticks.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0


def reconcile_retry_s(previous_s: float) -> float:
    """The wait before the next try after a failed reconcile whose last wait was
    ``previous_s`` (0: none yet): RETRY_FIRST_S, doubling, at most RETRY_MAX_S."""
    return min(RETRY_MAX_S, previous_s * 2) if previous_s else RETRY_FIRST_S
