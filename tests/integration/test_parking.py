"""The agent's parked processes (agent/parking.py), with real processes standing in for
parked ranks: which next-generation rank a parked process may become, and that every
one not adopted is told to exit and, if it does not, is killed with its group."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from agent.parking import RELEASE_GRACE_S, Parked, ParkingLot
from common.procs import group_alive, process_state
from protos import keel_pb2
from tests.conftest import wait_for

COMMAND = ("python", "-u", "train.py")


@pytest.fixture
def sleeper():
    """A process in its own group that ignores SIGTERM, as a parked rank would not exit
    on anything but its answer."""
    made = []

    def start():
        made.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "time.sleep(120)",
                ],
                start_new_session=True,
            )
        )
        return made[-1]

    yield start
    for popen in made:
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def parked(popen, slot=0, job="j", **overrides) -> Parked:
    fields = dict(
        popen=popen,
        job=job,
        generation=3,
        rank=slot,
        slot=slot,
        command=COMMAND,
        working_dir="/w",
        job_env={"A": "1"},
    )
    return Parked(**{**fields, **overrides})


def start(job="j", cold_start=False, env=None) -> keel_pb2.StartGeneration:
    return keel_pb2.StartGeneration(
        job=job,
        generation=4,
        command=COMMAND,
        working_dir="/w",
        env=env if env is not None else {"A": "1"},
        cold_start=cold_start,
    )


def test_a_parked_process_becomes_only_a_rank_of_its_own_slot_job_and_command(sleeper):
    lot = ParkingLot()
    lot.park("t0", parked(sleeper(), slot=0))
    lot.park("t1", parked(sleeper(), slot=1))
    slot = lambda n: keel_pb2.RankAssignment(rank=n, local_rank=n)  # noqa: E731
    for wrong in (start(job="other"), start(cold_start=True), start(env={"A": "2"})):
        assert lot.take(wrong, slot(0)) is None
    # Another rank on its slot: torch's DTensor would hand it its old rank's shards.
    assert lot.take(start(), keel_pb2.RankAssignment(rank=1, local_rank=0)) is None
    taken = lot.take(start(), slot(1))
    assert taken is lot.by_token["t1"]
    taken.start({"RANK": "1"}, "/out", "/err")
    assert lot.take(start(), slot(1)) is None, "given a rank once"
    # Its waiting NextGeneration call gets the rank, and the token is then forgotten.
    answer = lot.answer("t1")
    assert (answer.action, dict(answer.env), answer.stdout) == (
        keel_pb2.NEXT_GENERATION_ACTION_START,
        {"RANK": "1"},
        "/out",
    )
    assert lot.answer("t1") is None and lot.answer("made-up") is None
    # Nothing to say yet: the call is held, then answered "wait".
    assert lot.answer("t0").action == keel_pb2.NEXT_GENERATION_ACTION_WAIT
    # A stopped (SIGSTOPped) process would stall its rank: never handed one.
    stalled = lot.by_token["t0"]
    assert lot.take(start(), slot(0)) is stalled
    stalled.popen.send_signal(signal.SIGSTOP)
    wait_for(lambda: process_state(stalled.pid) == "T", timeout_s=10, what="the stop to show")
    assert lot.take(start(), slot(0)) is None
    stalled.popen.send_signal(signal.SIGCONT)


def test_released_processes_hear_exit_and_are_killed_if_they_stay(sleeper):
    lot = ParkingLot(ttl_s=3600)
    old = parked(sleeper())
    lot.park("old", old)
    heard = []
    waiting = threading.Thread(target=lambda: heard.append(lot.answer("old")))
    waiting.start()  # a NextGeneration call held open
    lot.release_all("generation 4 starts here without them", now=100.0)
    waiting.join(5)
    assert [(a.action, a.reason) for a in heard] == [
        (keel_pb2.NEXT_GENERATION_ACTION_EXIT, "generation 4 starts here without them")
    ]
    assert lot.answer("old").action == keel_pb2.NEXT_GENERATION_ACTION_EXIT, (
        "said again to every later call"
    )
    lot.poll(now=100.0 + RELEASE_GRACE_S / 2)
    assert old.popen.poll() is None, "it has the grace to exit by itself"
    lot.poll(now=100.0 + RELEASE_GRACE_S)
    assert old.popen.wait(10) == -signal.SIGKILL
    wait_for(lambda: not group_alive(old.pid), timeout_s=10, what="its group to go")
    lot.poll(now=200.0)
    assert lot.by_token == {}, "forgotten once it exited"


def test_one_parked_too_long_is_released_and_shutdown_kills_every_one(sleeper):
    lot = ParkingLot(ttl_s=60)
    stale, fresh = parked(sleeper(), since=0.0), parked(sleeper(), slot=1, since=50.0)
    lot.park("stale", stale)
    lot.park("fresh", fresh)
    lot.poll(now=61.0)
    assert stale.released_at == 61.0 and fresh.released_at is None
    assert lot.answer("stale").reason == "no generation took it in 60 s"
    lot.kill_all()
    assert stale.popen.returncode == fresh.popen.returncode == -signal.SIGKILL
    assert lot.by_token == {}
