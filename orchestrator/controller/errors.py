"""How a reconcile step fails. ``Terminal``: the job cannot go on, and ends FAILED with
the reason. A write that lost to a concurrent one (``store.StaleRevision``) reloads the
job's state and is tried again at once. Anything else (etcd out of reach, a bug) is
tried again after ``policy.guardrails.reconcile_retry_s``'s back-off, and said once."""

from __future__ import annotations


class Terminal(Exception):
    """The job cannot go on; the message is the reason it ends FAILED with."""
