"""Reading faulthandler dumps: real ones from child interpreters, and hand-cut text."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from agent.stacks import Frame, ThreadStack, dump_since, main_thread, parse_dump, where
from tests.conftest import wait_for

# Starts two threads in a known order, then dumps every thread from a named function of
# the main thread; prints the thread ids (main, first, second) so the test can check
# which listed stack is whose instead of assuming the order.
DUMP_FROM_MAIN = textwrap.dedent("""
    import faulthandler, threading
    release = threading.Event()
    first = threading.Thread(target=release.wait); first.start()
    second = threading.Thread(target=release.wait); second.start()
    def stuck_in_here():
        faulthandler.dump_traceback(all_threads=True)
    stuck_in_here()
    release.set()
    print(threading.main_thread().ident, first.ident, second.ident)
""")

# The rank's way: faulthandler registered on SIGUSR1, a helper thread, the main thread
# asleep in a named function when the agent's signal arrives.
SLEEP_UNTIL_SIGNALLED = textwrap.dedent("""
    import faulthandler, signal, sys, threading, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    def sleeps_in_here():
        print(threading.main_thread().ident, flush=True)
        time.sleep(30)
    sleeps_in_here()
""")

WORKER = ('Thread 0x00007f7bd26dc6c0 (most recent call first):\n'
          '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
          '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n')
MAIN = ('Current thread 0x00007f7bd3246b80 (most recent call first):\n'
        '  File "/work/keel/trainer/runtime.py", line 312 in inject_faults\n'
        '  File "/work/keel/trainer/train.py", line 245 in main\n')
DUMP = WORKER + "\n" + MAIN
PARSED = [
    ThreadStack("0x00007f7bd26dc6c0", False, (
        Frame("/usr/lib/python3.11/threading.py", 327, "wait"),
        Frame("/usr/lib/python3.11/threading.py", 1002, "_bootstrap"))),
    ThreadStack("0x00007f7bd3246b80", True, (
        Frame("/work/keel/trainer/runtime.py", 312, "inject_faults"),
        Frame("/work/keel/trainer/train.py", 245, "main"))),
]


def test_a_real_dump_lists_threads_newest_first_and_the_main_thread_last():
    run = subprocess.run([sys.executable, "-c", DUMP_FROM_MAIN], capture_output=True,
                         text=True, timeout=30, check=True)
    main_id, first_id, second_id = (int(ident) for ident in run.stdout.split())
    stacks = parse_dump(run.stderr)
    assert [int(t.thread_id, 16) for t in stacks] == [second_id, first_id, main_id]
    main = main_thread(stacks)
    assert main.current and main.frames[0].function == "stuck_in_here"
    assert main.frames[-1].function == "<module>"
    assert where(stacks) == f"stuck_in_here (<string>:{main.frames[0].line})"


def test_the_agents_way_sigusr1_then_the_new_tail_of_stderr(tmp_path):
    stderr_path = tmp_path / "rank0.stderr"
    stderr_path.write_text("step=41 loss=2.31\nan earlier line\n")
    before = stderr_path.read_text()
    with open(stderr_path, "a") as stderr:
        child = subprocess.Popen([sys.executable, "-c", SLEEP_UNTIL_SIGNALLED],
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        main_id = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGUSR1)
        wait_for(lambda: "in <module>\n" in stderr_path.read_text(), 10, 0.01, what="the stack dump")
        dump = dump_since(before, stderr_path.read_text())
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert dump.startswith("Thread 0x")
    stacks = parse_dump(dump)
    assert len(stacks) == 2 and int(main_thread(stacks).thread_id, 16) == main_id
    assert where(stacks).startswith("sleeps_in_here (<string>:")


def test_garbage_around_the_dump_is_ignored():
    text = ("step=12 loss=2.4\n  File \"orphan.py\", line 1 in cut_off_header\n\n"
            + DUMP + "\nW0612 12:00:01 nccl warning\n")
    assert parse_dump(text) == PARSED
    assert where(parse_dump(text)) == "inject_faults (trainer/runtime.py:312)"


def test_of_two_dumps_the_last_wins():
    older = DUMP.replace("line 312 in inject_faults", "line 99 in load_batch")
    assert parse_dump(older + DUMP) == PARSED                      # back to back
    assert parse_dump(older + "step=13\n" + DUMP) == PARSED        # output between
    assert parse_dump(DUMP + "\n" + DUMP) == PARSED                # a thread id repeats


@pytest.mark.parametrize("name, text, expected", [
    ("cut within a frame line", DUMP[:-10], []),
    ("cut after the blank line before the main thread", WORKER + "\n", []),
    ("cut after a header", WORKER + "\n" + MAIN.splitlines(keepends=True)[0], []),
    ("a cut dump after a complete one: the complete one",
     DUMP + "step=14\n" + DUMP[:-10], PARSED),
    ("cut at the start: the threads after the cut",
     DUMP[DUMP.index("line 327"):], PARSED[1:]),
    ("past the thread limit (the main thread is not listed)", DUMP + "\n...\n", []),
    ("a line still being written that is not the dump's", DUMP + "step=1", PARSED),
    ("nothing", "", []),
])
def test_truncated_dumps(name, text, expected):
    assert parse_dump(text) == expected, name


def test_frames_faulthandler_could_not_place():
    text = ('Stack (most recent call first):\n'
            '  File "x.py", line ??? in f\n'
            '  ...\n'
            'Thread 0x0000000000000001 (most recent call first):\n'
            '  <no Python frame>\n')
    assert parse_dump(text) == [ThreadStack("0x0000000000000001", False, ())]
    assert where(parse_dump(text)) == "no Python frame in the main thread"
    assert parse_dump(text[:text.index("Thread")]) == [
        ThreadStack("", True, (Frame("x.py", 0, "f"),))]
    assert where([]) == ""


@pytest.mark.parametrize("name, before, after, new", [
    ("the file grew", "a\nb\n", "a\nb\nc\n", "c\n"),
    ("nothing new", "a\nb\n", "a\nb\n", ""),
    ("the tail window moved", "0123456789", "56789ABCDE", "ABCDE"),
    ("repeated text in the overlap", "xxabab", "ababab", "ab"),
    ("no overlap: all of it", "old tail", "new file", "new file"),
    ("an empty file before", "", "x\n", "x\n"),
    ("an empty file after", "x\n", "", ""),
])
def test_dump_since(name, before, after, new):
    assert dump_since(before, after) == new, name
