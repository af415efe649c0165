"""Guard rails on automatic remediation: cordoning repeat offenders, capping
replacements, backing off restarts. Pure; times are seconds on the caller's clock."""

from __future__ import annotations

from collections.abc import Sequence

HOUR_S = 3600.0
CORDON_AFTER_FLAGS = 2          # a node flagged this often within an hour is cordoned
MAX_BACKOFF_S = 30.0


def should_cordon(flag_times: Sequence[float], now: float) -> bool:
    """True when a node has been flagged ``CORDON_AFTER_FLAGS`` times in the last hour:
    replacing it again would only move the job back onto it later."""
    return sum(1 for t in flag_times if now - t <= HOUR_S) >= CORDON_AFTER_FLAGS


def replacement_allowed(replacement_times: Sequence[float], now: float,
                        per_hour: int) -> bool:
    """False once ``per_hour`` replacements happened in the last hour: beyond that the
    cause is likelier the job or the cluster than one node, and a person should look."""
    return sum(1 for t in replacement_times if now - t <= HOUR_S) < per_hour


def restart_backoff_s(restarts: int) -> float:
    """Seconds to wait before starting generation ``restarts + 1`` after a failure:
    none for the first start, then 0.5 s doubling per restart, capped at 30 s."""
    if restarts <= 0:
        return 0.0
    return min(MAX_BACKOFF_S, 0.5 * 2 ** (restarts - 1))
