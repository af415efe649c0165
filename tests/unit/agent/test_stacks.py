"""Reading faulthandler dumps: hand-cut text (real dumps from child interpreters are in
tests/integration/test_agent_processes.py)."""

import pytest

from agent.stacks import Frame, ThreadStack, dump_since, parse_dump, where

WORKER = (
    "Thread 0x00007f7bd26dc6c0 (most recent call first):\n"
    '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
    '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n'
)
MAIN = (
    "Current thread 0x00007f7bd3246b80 (most recent call first):\n"
    '  File "/work/keel/trainer/runtime.py", line 312 in inject_faults\n'
    '  File "/work/keel/trainer/train.py", line 245 in main\n'
)
DUMP = WORKER + "\n" + MAIN
PARSED = [
    ThreadStack(
        "0x00007f7bd26dc6c0",
        False,
        (
            Frame("/usr/lib/python3.11/threading.py", 327, "wait"),
            Frame("/usr/lib/python3.11/threading.py", 1002, "_bootstrap"),
        ),
    ),
    ThreadStack(
        "0x00007f7bd3246b80",
        True,
        (
            Frame("/work/keel/trainer/runtime.py", 312, "inject_faults"),
            Frame("/work/keel/trainer/train.py", 245, "main"),
        ),
    ),
]


def test_garbage_around_the_dump_is_ignored():
    text = (
        'step=12 loss=2.4\n  File "orphan.py", line 1 in cut_off_header\n\n'
        + DUMP
        + "\nW0612 12:00:01 nccl warning\n"
    )
    assert parse_dump(text) == PARSED
    assert where(parse_dump(text)) == "inject_faults (trainer/runtime.py:312)"


def test_of_two_dumps_the_last_wins():
    older = DUMP.replace("line 312 in inject_faults", "line 99 in load_batch")
    assert parse_dump(older + DUMP) == PARSED  # back to back
    assert parse_dump(older + "step=13\n" + DUMP) == PARSED  # output between
    assert parse_dump(DUMP + "\n" + DUMP) == PARSED  # a thread id repeats


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("cut within a frame line", DUMP[:-10], []),
        ("cut after the blank line before the main thread", WORKER + "\n", []),
        ("cut after a header", WORKER + "\n" + MAIN.splitlines(keepends=True)[0], []),
        (
            "a cut dump after a complete one: the complete one",
            DUMP + "step=14\n" + DUMP[:-10],
            PARSED,
        ),
        ("cut at the start: the threads after the cut", DUMP[DUMP.index("line 327") :], PARSED[1:]),
        ("past the thread limit (the main thread is not listed)", DUMP + "\n...\n", []),
        ("a line still being written that is not the dump's", DUMP + "step=1", PARSED),
        ("nothing", "", []),
    ],
)
def test_truncated_dumps(name, text, expected):
    assert parse_dump(text) == expected, name


def test_frames_faulthandler_could_not_place():
    text = (
        "Stack (most recent call first):\n"
        '  File "x.py", line ??? in f\n'
        "  ...\n"
        "Thread 0x0000000000000001 (most recent call first):\n"
        "  <no Python frame>\n"
    )
    assert parse_dump(text) == [ThreadStack("0x0000000000000001", False, ())]
    assert where(parse_dump(text)) == "no Python frame in the main thread"
    assert parse_dump(text[: text.index("Thread")]) == [
        ThreadStack("", True, (Frame("x.py", 0, "f"),))
    ]
    assert where([]) == ""


@pytest.mark.parametrize(
    "name, before, after, new",
    [
        ("the file grew", "a\nb\n", "a\nb\nc\n", "c\n"),
        ("nothing new", "a\nb\n", "a\nb\n", ""),
        ("the tail window moved", "0123456789", "56789ABCDE", "ABCDE"),
        ("repeated text in the overlap", "xxabab", "ababab", "ab"),
        ("no overlap: all of it", "old tail", "new file", "new file"),
        ("an empty file before", "", "x\n", "x\n"),
        ("an empty file after", "x\n", "", ""),
    ],
)
def test_dump_since(name, before, after, new):
    assert dump_since(before, after) == new, name
