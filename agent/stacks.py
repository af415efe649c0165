"""Reading the thread dumps ranks write to stderr on SIGUSR1.

A rank registers ``faulthandler.register(signal.SIGUSR1, all_threads=True)``; on the
signal, CPython writes every thread's Python frames to the rank's stderr::

    Thread 0x00007f7bd26dc6c0 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 327 in wait
      ...

    Current thread 0x00007f7bd3246b80 (most recent call first):
      File "trainer/runtime.py", line 312 in inject_faults
      File "trainer/train.py", line 245 in main

Threads are separated by one blank line and listed newest first, so the main thread
comes last. The agent reads the stderr tail before and after the signal; ``dump_since``
keeps what the signal added, ``parse_dump`` reads it and ``where`` says, in one line,
where the main thread is. Pure text functions: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)\b.*\(most recent call first\):$")
_STACK = "Stack (most recent call first):"  # the header of a one-thread dump
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')
# Lines faulthandler writes in place of frames: no Python frame, frames elided past
# its depth limit, a thread caught collecting garbage.
_NOTES = ("  <no Python frame>", "  ...", "  Garbage-collecting")
# Written instead of further threads past faulthandler's thread limit: the oldest
# threads, the main thread among them, are missing from such a dump.
_THREADS_ELIDED = "..."


@dataclass(frozen=True)
class Frame:
    file: str  # as faulthandler printed it: absolute, relative or "<string>"
    line: int  # 0 when faulthandler could not tell ("line ???")
    function: str


@dataclass(frozen=True)
class ThreadStack:
    thread_id: str  # "0x00007f7bd3246b80"; "" in a one-thread dump
    current: bool  # the thread that wrote the dump
    frames: tuple[Frame, ...]  # innermost first, as faulthandler prints them


def parse_dump(text: str) -> list[ThreadStack]:
    """The threads of the last complete dump in ``text``, in the order printed (newest
    first), or [] if there is none. Other output around a dump is ignored; so are
    frames whose thread header was cut off the start of ``text``. A dump cut off at the
    end of ``text`` is not complete: its last listed thread would not be the main one."""
    *lines, partial = text.split("\n")  # partial: a last line still without its newline
    last_complete: list[ThreadStack] = []
    dump: list[ThreadStack] = []  # threads of the dump being read
    frames: list[Frame] = []  # frames of its last thread
    has_lines = False  # its last thread has a frame (or note) line yet
    blank = False  # a blank line after that thread: another may follow

    def close():
        nonlocal last_complete, dump, frames, has_lines, blank
        if dump and has_lines:
            last_complete = _with_frames(dump, frames)
        dump, frames, has_lines, blank = [], [], False, False

    for line in lines:
        header = _HEADER.match(line)
        frame = _FRAME.match(line)
        if header or line == _STACK:
            thread_id = header.group(2) if header else ""
            if dump and blank and thread_id not in {t.thread_id for t in dump}:
                dump = _with_frames(dump, frames)
            else:
                close()
            current = not header or header.group(1) == "Current thread"
            dump.append(ThreadStack(thread_id, current, ()))
            frames, has_lines, blank = [], False, False
        elif dump and not blank and (frame or line in _NOTES):
            if frame:
                number = 0 if frame.group(2) == "???" else int(frame.group(2))
                frames.append(Frame(frame.group(1), number, frame.group(3)))
            has_lines = True
        elif dump and not blank and line == "" and has_lines:
            blank = True
        elif dump and line == _THREADS_ELIDED:
            dump = []
        else:
            close()
    # At the end of the text, a blank line or a partly written dump line means the dump
    # is still being written (or was cut): more threads, the main one last, may follow.
    if not (blank or (partial and _may_be_dump_line(partial))):
        close()
    return last_complete


def _may_be_dump_line(partial: str) -> bool:
    """Whether ``partial``, the start of a line, may be the start of a dump line."""
    starts = ('  File "', "Thread 0x", "Current thread 0x", _STACK, *_NOTES, _THREADS_ELIDED)
    return any(partial.startswith(s) or s.startswith(partial) for s in starts)


def _with_frames(dump: list[ThreadStack], frames: list[Frame]) -> list[ThreadStack]:
    """``dump`` with ``frames`` given to its last thread."""
    last = dump[-1]
    return dump[:-1] + [ThreadStack(last.thread_id, last.current, tuple(frames))]


def main_thread(stacks: Sequence[ThreadStack]) -> ThreadStack | None:
    """The main thread of a parsed dump: CPython lists threads newest first, so it is
    the last one (tests/unit/test_stacks.py checks this against a real dump)."""
    return stacks[-1] if stacks else None


def where(stacks: Sequence[ThreadStack]) -> str:
    """Where the main thread is, e.g. "inject_faults (trainer/runtime.py:312)": its
    innermost Python frame, the file shortened to its last two path components. C
    functions (time.sleep, a NCCL wait) never appear in a faulthandler dump; the frame
    named is the Python code that called them. "" when there is no main thread."""
    thread = main_thread(stacks)
    if thread is None:
        return ""
    if not thread.frames:
        return "no Python frame in the main thread"
    frame = thread.frames[0]
    short = "/".join(frame.file.split("/")[-2:])
    return f"{frame.function} ({short}:{frame.line})"


def dump_since(text_before: str, text_after: str) -> str:
    """What was appended to a file between two reads of its tail: ``text_after`` less
    the longest start of it that ends ``text_before``. When the tails do not overlap
    (the file grew by more than a tail, or was replaced), all of ``text_after``."""
    # Knuth-Morris-Pratt: match text_after as a pattern along text_before; the match
    # length at the end of text_before is the overlap. Linear in the tails' size.
    if text_after.startswith(text_before):
        return text_after[len(text_before) :]
    if not text_after:
        return ""
    failure = [0] * len(text_after)
    k = 0
    for i in range(1, len(text_after)):
        while k and text_after[i] != text_after[k]:
            k = failure[k - 1]
        if text_after[i] == text_after[k]:
            k += 1
        failure[i] = k
    k = 0
    for char in text_before:
        if k == len(text_after):
            k = failure[k - 1]
        while k and char != text_after[k]:
            k = failure[k - 1]
        if char == text_after[k]:
            k += 1
    return text_after[k:]
