"""Which of a job's checkpoint records and events etcd keeps, and how much of each
event's text. Pure: the controller passes the records, the restore points in use and
the events, and deletes (or stores) what this returns."""

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


def events_kept(sizes: Sequence[int], max_events: int, max_bytes: int) -> int:
    """How many of a job's newest events it keeps, given each event's size in bytes
    (oldest first): at most ``max_events``, and no more than fit in ``max_bytes``, but
    always the newest one, whatever its size."""
    total, keep = 0, 0
    for size in reversed(sizes):
        total += size
        if keep == max_events or (keep and total > max_bytes):
            break
        keep += 1
    return keep


# Bytes of one text field of an event (its reason, root cause) kept: an agent-supplied
# reason of megabytes is cut to this, rather than evict the job's history (the events
# are kept within a byte budget) and then fail to save in etcd every tick.
EVENT_TEXT_BYTES = 16 * 1024


def cut_text(text: str, limit: int = EVENT_TEXT_BYTES) -> str:
    """``text`` itself if its UTF-8 fits in ``limit`` bytes; else its start, cut at a
    character, saying how much was left out."""
    if len(text) * 4 <= limit:
        return text  # fits whatever its characters
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: max(0, limit - 64)].decode(errors="ignore")
    return f"{kept}... [{len(raw) - len(kept.encode())} more bytes cut]"
