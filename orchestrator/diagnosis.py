"""Reading a hang's stacks: which rank stopped where, and which ranks waited on it.

Agents send, per rank, a first line naming where its main thread is (e.g. "time.sleep
in inject_faults (trainer/runtime.py:312)") followed by the faulthandler dump. A rank
whose main thread sits in a collective is waiting on a peer; the one that is not is the
culprit. Pure.
"""

from __future__ import annotations

# Frames that mean "blocked in communication with peers".
COLLECTIVE_MARKERS = ("distributed_c10d", "all_reduce", "all_gather", "reduce_scatter",
                      "broadcast", "barrier", "/pipelining/", "_wait", "wait (",
                      "in wait", "recv", "send")


def waiting_in_collective(stack: str) -> bool:
    first_line, _, dump = stack.partition("\n")
    text = (first_line + "\n" + _main_thread_block(dump)).lower()
    return any(marker in text for marker in COLLECTIVE_MARKERS)


def _main_thread_block(dump: str) -> str:
    # CPython lists the main thread last in a faulthandler dump.
    at = max(dump.rfind("Thread 0x"), dump.rfind("Current thread 0x"))
    return dump[at:] if at >= 0 else dump


def culprit(stacks: dict[int, str]) -> int | None:
    """The lowest rank not waiting in a collective, or None if every rank waits (the
    culprit is then on a node that did not report)."""
    free = sorted(rank for rank, stack in stacks.items() if not waiting_in_collective(stack))
    return free[0] if free else None


def summarize(stacks: dict[int, str]) -> str:
    """One sentence: the culprit and where it stopped, and who waited."""
    if not stacks:
        return "no stacks were collected"
    rank = culprit(stacks)
    waiting = sorted(r for r, s in stacks.items() if waiting_in_collective(s))
    parts = []
    if rank is not None:
        parts.append(f"rank {rank} stopped in {stacks[rank].partition(chr(10))[0]}")
    else:
        parts.append("every reporting rank was waiting in a collective")
    if waiting:
        parts.append(f"rank{'s' if len(waiting) > 1 else ''} "
                     f"{', '.join(map(str, waiting))} waiting in collectives")
    return "; ".join(parts)
