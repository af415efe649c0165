"""Reading a hang's stacks: which rank stopped where, and which ranks waited on it.

Agents send, per rank, a first line naming where its main thread is (e.g. "time.sleep
in inject_faults (trainer/runtime.py:312)") followed by the faulthandler dump. A rank
whose main thread sits in a collective is waiting on a peer; the one that is not is the
culprit. Each stack is read once, as it arrives (``waiting_in_collective``); the
verdicts and the first lines are all the rest needs. Pure.
"""

from __future__ import annotations

# Frames that mean "blocked in communication with peers".
COLLECTIVE_MARKERS = (
    "distributed_c10d",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "/pipelining/",
    "_wait",
    "wait (",
    "in wait",
    "recv",
    "send",
)


def waiting_in_collective(stack: str) -> bool:
    first_line, _, dump = stack.partition("\n")
    text = (first_line + "\n" + _main_thread_block(dump)).lower()
    return any(marker in text for marker in COLLECTIVE_MARKERS)


def _main_thread_block(dump: str) -> str:
    # CPython lists the main thread last in a faulthandler dump.
    at = max(dump.rfind("Thread 0x"), dump.rfind("Current thread 0x"))
    return dump[at:] if at >= 0 else dump


def culprit(waiting: dict[int, bool]) -> int | None:
    """The lowest rank not waiting in a collective (``waiting``: rank -> whether its
    stack waits in one), or None if every rank waits (the culprit is then on a node
    that did not report)."""
    free = sorted(rank for rank, waits in waiting.items() if not waits)
    return free[0] if free else None


def summarize(where: dict[int, str], waiting: dict[int, bool]) -> str:
    """One sentence: the culprit and where it stopped (``where``: rank -> its stack's
    first line), and who waited."""
    if not waiting:
        return "no stacks were collected"
    rank = culprit(waiting)
    waiters = sorted(r for r, waits in waiting.items() if waits)
    parts = []
    if rank is not None:
        parts.append(f"rank {rank} stopped in {where.get(rank, 'an unknown place')}")
    else:
        parts.append("every reporting rank was waiting in a collective")
    if waiters:
        parts.append(
            f"rank{'s' if len(waiters) > 1 else ''} "
            f"{', '.join(map(str, waiters))} waiting in collectives"
        )
    return "; ".join(parts)
