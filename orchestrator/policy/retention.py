"""Which of a job's checkpoint records etcd keeps. Pure: the controller passes the
records and the restore points in use, and deletes what this returns."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from common.records import CheckpointRecord

# Records kept per job, newest first (and the restore point in use, whatever its age):
# more than any retention keeps directories of, so every restore candidate has one.
RECORDS_KEPT = 16


def records_to_prune(records: Sequence[CheckpointRecord], in_use: Collection[str]) -> list[int]:
    """The steps of ``records`` (oldest first) to delete: all but the newest
    RECORDS_KEPT, sparing any whose path is ``in_use`` (the generation's restore point
    and its fallbacks)."""
    keep = {r.step for r in records[-RECORDS_KEPT:]}
    return [r.step for r in records if r.step not in keep and r.path not in in_use]
