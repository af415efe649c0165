"""Exits dated by their earliest evidence, so that the root cause of a generation's
failure is the rank that failed first, even when one poll finds both exits."""

from __future__ import annotations

import subprocess
import time

from agent.supervisor import RankProcess, Supervisor


def sleeper(tmp_path, rank: int) -> RankProcess:
    popen = subprocess.Popen(["sleep", "60"], start_new_session=True)
    return RankProcess("j", 1, rank=rank, local_rank=rank % 2, popen=popen, log_dir=tmp_path)


def test_a_rank_killed_before_a_peers_exception_is_dated_before_it(tmp_path):
    """Rank 2 is SIGKILLed (no error file), then rank 3 writes its exception and dies,
    and a busy agent's next poll finds both. Dated by that poll, rank 2 counted as dying
    after rank 3's exception, and rank 3 was named the root cause (a keel up test saw
    it in CI): rank 2 is dated by the last poll that found it running."""
    supervisor = Supervisor(tmp_path)
    killed, peer = sleeper(tmp_path, 2), sleeper(tmp_path, 3)
    supervisor.ranks = [peer, killed]  # the peer looked at first
    try:
        assert supervisor.poll(time.monotonic()) == []
        polled = time.time()
        killed.popen.kill()
        killed.popen.wait()
        # A file's mtime comes from the kernel's coarse clock, up to a tick (1-10 ms)
        # behind time.time(): written within a tick of the poll, the exception could
        # be dated before it (CI saw it). A real peer's exception follows its peer's
        # death by a collective's timeout at least; it is written until it is dated
        # after the poll.
        while True:
            peer.error_file.write_text('{"message": {"message": "RuntimeError: peer gone"}}')
            if peer.error_file.stat().st_mtime > polled:
                break
        peer.popen.kill()
        peer.popen.wait()
        exited = supervisor.poll(time.monotonic())
    finally:
        for proc in (killed, peer):
            proc.popen.kill()
            proc.popen.wait()
    assert {p.rank for p in exited} == {2, 3}
    assert killed.exit_report.signal == 9
    assert killed.exit_report.exited_at < peer.exit_report.exited_at
    assert peer.exit_report.exited_at == peer.error_file.stat().st_mtime


def test_a_rank_never_seen_running_is_dated_by_the_poll_that_reaped_it(tmp_path):
    supervisor = Supervisor(tmp_path)
    proc = sleeper(tmp_path, 0)
    supervisor.ranks = [proc]
    proc.popen.kill()
    proc.popen.wait()
    before = time.time()
    (exited,) = supervisor.poll(time.monotonic())
    assert before <= exited.exit_report.exited_at <= time.time()
