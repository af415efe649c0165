"""Which of a job's checkpoint records and events etcd keeps, and how much of each
event's text; and which agents' sessions the controller keeps in memory. Pure: the
controller passes the records, the restore points in use, the events and the sessions
that are down, and deletes (or stores) what this returns."""

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


# An agent's session (what its Hello said) is kept this long after its stream went
# down: operators see the node as disconnected (``keel nodes``), and an agent back
# within it is shown with its history. A node a job's placement holds is never
# forgotten: whether it counts as lost is judged by how long its stream has been down.
SESSION_KEPT_S = 3600.0


def sessions_to_forget(
    now: float, down: Sequence[tuple[str, float]], kept_s: float, max_kept: int
) -> list[str]:
    """The nodes whose sessions to forget, of ``down``: each a session whose stream is
    down and whose node no job's placement holds, as its node and when its stream went
    down (monotonic seconds). Those down for longer than ``kept_s``, and past the
    newest ``max_kept`` the oldest: the memory for node names ever seen stays bounded
    however many come and go. In the order of ``down``."""
    newest = sorted(down, key=lambda item: item[1], reverse=True)[:max_kept]
    keep = {node for node, since in newest if now - since <= kept_s}
    return [node for node, _ in down if node not in keep]
