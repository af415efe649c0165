"""The agent's dealings with real processes: a restarted agent cleans up after its
predecessor (and never after a live agent), a rank moves only along its lifecycle,
and the thread dumps ranks write on SIGUSR1 read as the agent reads them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from agent.leftovers import RunDirInUse, carrying, started_at, take_over
from agent.stacks import dump_since, main_thread, parse_dump, where
from agent.supervisor import RANK_TRANSITIONS, IllegalRankTransition, RankPhase, RankProcess
from tests.conftest import wait_for


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_processes_left_by_the_previous_agent_are_killed_and_ours_recorded(tmp_path):
    socket = str(tmp_path / "old" / "agent.sock")
    env = {**os.environ, "KEEL_AGENT_SOCKET": socket}
    left = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], env={**env, "KEEL_AGENT_SOCKET": socket + "x"})
    try:
        (tmp_path / "agent.json").write_text(json.dumps({"pid": _dead_pid(), "socket": socket}))
        # (Until it has exec'd, the child still carries our environment.)
        wait_for(
            lambda: carrying(f"KEEL_AGENT_SOCKET={socket}") == [left.pid],
            10,
            what="the leftover to carry its marker",
        )
        assert take_over(tmp_path, "/new/agent.sock") == 1
        assert left.wait(5) == -9
        assert other.poll() is None, "a process of another agent was killed"
        assert json.loads((tmp_path / "agent.json").read_text()) == {
            "pid": os.getpid(),
            "started": started_at(os.getpid()),
            "socket": "/new/agent.sock",
        }
    finally:
        for proc in (left, other):
            proc.kill()
            proc.wait()


def test_a_run_dir_owned_by_a_live_agent_is_refused_and_a_reused_pid_is_not(tmp_path):
    live = subprocess.Popen(["sleep", "60"])
    try:
        record = {"pid": live.pid, "started": started_at(live.pid), "socket": "/s"}
        (tmp_path / "agent.json").write_text(json.dumps(record))
        with pytest.raises(RunDirInUse, match=f"agent pid {live.pid} is running"):
            take_over(tmp_path, "/new/agent.sock")
        assert json.loads((tmp_path / "agent.json").read_text()) == record
        # The same pid with another start time is another process (the pid was reused).
        (tmp_path / "agent.json").write_text(json.dumps({**record, "started": 1}))
        assert take_over(tmp_path, "/new/agent.sock") == 0
        assert json.loads((tmp_path / "agent.json").read_text())["pid"] == os.getpid()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("text", ["[]", '{"pid": "12"}', '{"socket": "/s"}', "not json"])
def test_a_malformed_record_is_treated_as_no_previous_agent(tmp_path, text):
    (tmp_path / "agent.json").write_text(text)
    assert take_over(tmp_path, "/new/agent.sock") == 0
    assert json.loads((tmp_path / "agent.json").read_text())["socket"] == "/new/agent.sock"


@pytest.fixture
def rank():
    popen = subprocess.Popen(["true"])
    popen.wait()
    return RankProcess(job="j", generation=1, rank=0, local_rank=0, popen=popen, log_dir=None)


def test_a_rank_moves_only_along_its_table(rank):
    rank.move(RankPhase.STOPPING, "SIGTERM")
    rank.move(RankPhase.KILLED, "grace over")
    rank.move(RankPhase.EXITED, "reaped")
    with pytest.raises(IllegalRankTransition, match="cannot go from EXITED to RUNNING"):
        rank.move(RankPhase.RUNNING, "back from the dead")
    rank.move(RankPhase.REAPED, "group empty")
    assert RANK_TRANSITIONS[RankPhase.REAPED] == frozenset()
    # Every phase has its row in the table.
    assert set(RANK_TRANSITIONS) == set(RankPhase)


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


def test_a_real_dump_lists_threads_newest_first_and_the_main_thread_last():
    run = subprocess.run(
        [sys.executable, "-c", DUMP_FROM_MAIN],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    main_id, first_id, second_id = (int(ident) for ident in run.stdout.split())
    stacks = parse_dump(run.stderr)
    assert [int(t.thread_id, 16) for t in stacks] == [second_id, first_id, main_id]
    main = main_thread(stacks)
    assert main.current and main.frames[0].function == "stuck_in_here"
    assert main.frames[-1].function == "<module>"
    assert where(stacks) == f"stuck_in_here (<string>:{main.frames[0].line})"


def test_the_agents_way_sigusr1_then_the_new_tail_of_stderr(tmp_path):
    stderr_path = tmp_path / "rank0.stderr"
    stderr_path.write_text('{"event": "step", "step": 41, "loss": 2.31}\nan earlier line\n')
    before = stderr_path.read_text()
    with open(stderr_path, "a") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", SLEEP_UNTIL_SIGNALLED],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        main_id = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGUSR1)
        wait_for(
            lambda: "in <module>\n" in stderr_path.read_text(), 10, 0.01, what="the stack dump"
        )
        dump = dump_since(before, stderr_path.read_text())
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert dump.startswith("Thread 0x")
    stacks = parse_dump(dump)
    assert len(stacks) == 2 and int(main_thread(stacks).thread_id, 16) == main_id
    assert where(stacks).startswith("sleeps_in_here (<string>:")
