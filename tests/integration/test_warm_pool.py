"""Warm processes (agent/pool.py, agent/warm.py): a rank started from one sees what a
fresh `python -u SCRIPT` or `python -u -m MODULE` would, exits as it would, and a pool
process that died is never handed out."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from agent.pool import WarmPool, pool_env, warm_args
from common.procs import process_state
from tests.conftest import REPO, wait_for
from tests.integration.test_keel_up import run_up

INTROSPECT = REPO / "tests" / "integration" / "scripts" / "introspect.py"


@pytest.fixture
def pool(tmp_path):
    made = WarmPool(
        2,
        tmp_path / "pool",
        pool_env(dict(os.environ), "/tmp/none.sock"),
        refill_delay_s=0.0,
        eager=False,
    )
    made.refill(time.monotonic())
    assert made.idle == {}, "a lazy agent that has started no rank keeps no warm process"
    assert made.take(0, [sys.executable, "-u", "x.py"], {}, time.monotonic()) is None
    made.refill(time.monotonic())  # a rank started (cold): now the pool fills
    assert sorted(made.idle) == [0, 1]
    yield made
    made.close()


def cold(command, env, cwd, out, err):
    with open(out, "ab") as o, open(err, "ab") as e:
        return subprocess.run(
            command, env=env, cwd=cwd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, timeout=120
        ).returncode


def warm(pool, slot, command, env, cwd, out, err):
    popen = pool.take(slot, command, {}, time.monotonic())
    assert popen is not None
    pool.hand(popen, command, env, str(cwd), out, err)
    return popen


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_warm_rank_sees_what_a_cold_one_sees(pool, tmp_path, how):
    cwd = tmp_path / "work"
    cwd.mkdir()
    if how == "script":
        command = [sys.executable, "-u", str(INTROSPECT), "3"]
    else:
        shutil.copy(INTROSPECT, cwd / "introspect_mod.py")
        command = [sys.executable, "-u", "-m", "introspect_mod", "3"]
    env = {"PATH": os.environ["PATH"], "PROBE": "yes", "PYTHONPATH": str(REPO)}
    seen = {}
    for kind in ("cold", "warm"):
        out, err = tmp_path / f"{kind}.out", tmp_path / f"{kind}.err"
        if kind == "cold":
            code = cold(command, env, cwd, out, err)
        else:
            code = warm(pool, 0, command, env, cwd, out, err).wait(120)
        seen[kind] = (code, json.loads(out.read_text()), err.read_text())
    assert seen["warm"] == seen["cold"]
    code, facts, stderr = seen["warm"]
    assert code == 3 and facts["name"] == "__main__" and facts["probe"] == "yes"
    assert facts["cwd"] == str(cwd) and facts["stdin_at_end"] and stderr == "to stderr\n"
    assert "KEEL_AGENT_SOCKET" not in facts["env_keys"]  # only what the rank was given


def test_a_warm_rank_fails_and_is_signalled_as_a_cold_one(pool, tmp_path):
    env = {"PATH": os.environ["PATH"]}
    out, err = tmp_path / "r.out", tmp_path / "r.err"
    code = warm(
        pool, 0, [sys.executable, "-u", str(INTROSPECT), "raise"], env, tmp_path, out, err
    ).wait(120)
    assert code == 1
    assert "RuntimeError: raised on purpose" in err.read_text()
    assert err.read_text().startswith("to stderr\nTraceback (most recent call last):")
    waiting = warm(
        pool,
        1,
        [sys.executable, "-u", str(INTROSPECT), "wait"],
        env,
        tmp_path,
        tmp_path / "w.out",
        tmp_path / "w.err",
    )
    out = tmp_path / "w.out"
    wait_for(lambda: out.exists() and "waiting" in out.read_text(), 60, what="it to wait")
    os.killpg(waiting.pid, signal.SIGTERM)  # the agent's stop: its process group
    assert waiting.wait(30) == -signal.SIGTERM


def test_a_dead_or_unsuitable_warm_process_is_never_handed_out(pool, tmp_path):
    command = [sys.executable, "-u", str(INTROSPECT)]
    victim = pool.idle[0].popen
    victim.kill()
    victim.wait()
    assert pool.take(0, command, {}, time.monotonic()) is None  # the rank starts cold
    pool.refill(time.monotonic())
    assert pool.idle[0].popen.poll() is None and pool.idle[0].popen is not victim
    for unsuitable in (
        ["/bin/true"],
        [sys.executable, "-X", "dev", "x.py"],
        [sys.executable, "-c", "print(1)"],
        [sys.executable, "-m"],
    ):
        assert warm_args(unsuitable) is None
        assert pool.take(1, unsuitable, {}, time.monotonic()) is None
    assert pool.take(1, command, {"CUDA_VISIBLE_DEVICES": "3"}, time.monotonic()) is None
    assert warm_args([sys.executable, "-u", "-m", "pkg.mod", "a"]) == ["-m", "pkg.mod", "a"]
    # Another environment's python, though it links to the same interpreter binary.
    other = tmp_path / "other-venv" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.symlink_to(os.path.realpath(sys.executable))
    assert warm_args([str(other), "t.py"]) is None
    assert warm_args([sys.executable, "t.py", "-u"]) == ["t.py", "-u"]


def test_a_stalled_warm_process_is_never_handed_out_and_readiness_is_seen(pool, tmp_path):
    """A pool process stopped by SIGSTOP (a gray failure: alive, its pipe open) would
    stall the rank it became: it is replaced, not handed out. One that finished its
    imports says so on its pipe."""
    wait_for(
        lambda: (pool.refill(time.monotonic()), pool.idle[1].ready_at is not None)[1],
        timeout_s=120,
        what="the warm process of slot 1 to finish its imports",
    )
    stalled = pool.idle[1].popen
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: process_state(stalled.pid) == "T", timeout_s=10, what="the stop to take effect"
        )
        assert pool.take(1, [sys.executable, "-u", str(INTROSPECT)], {}, time.monotonic()) is None
        assert stalled.wait(10) == -signal.SIGKILL  # discarded, not left stopped
        pool.refill(time.monotonic())
        assert pool.idle[1].popen.pid != stalled.pid and pool.idle[1].popen.poll() is None
        assert pool.idle[1].ready_at is None  # the new one is still importing
    finally:
        if stalled.poll() is None:
            os.kill(stalled.pid, signal.SIGKILL)


def test_a_warm_process_has_the_distributed_stack_imported_before_its_rank(pool, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\nprint(sorted(m for m in ('torch', 'torch.distributed.fsdp', "
        "'torch.distributed.checkpoint', 'torch.distributed.pipelining') "
        "if m in sys.modules))\n"
    )
    out = tmp_path / "p.out"
    assert (
        warm(
            pool,
            0,
            [sys.executable, "-u", str(probe)],
            {"PATH": os.environ["PATH"]},
            tmp_path,
            out,
            tmp_path / "p.err",
        ).wait(120)
        == 0
    )
    # Imported ahead (agent.warm.DEFAULT_IMPORTS); pipelining only when asked for.
    assert (
        out.read_text().strip()
        == "['torch', 'torch.distributed.checkpoint', 'torch.distributed.fsdp']"
    )


def test_an_eager_pool_is_full_from_the_start_and_refilled_right_after_a_take(tmp_path):
    made = WarmPool(2, tmp_path / "pool", pool_env(dict(os.environ), "/tmp/none.sock"))
    taken = None
    try:
        made.refill(time.monotonic())
        assert sorted(made.idle) == [0, 1], "filled before any rank started here"
        first = made.idle[0].popen.pid
        taken = made.take(0, [sys.executable, "-u", "x.py"], {}, time.monotonic())
        assert taken is not None and taken.pid == first and sorted(made.idle) == [1]
        made.refill(time.monotonic())  # the next tick: not 10 s later
        assert sorted(made.idle) == [0, 1] and made.idle[0].popen.pid != first
    finally:
        made.close()
        if taken is not None:
            taken.kill()
            taken.wait()


def test_a_job_s_first_generation_starts_warm_where_the_agents_fill_eagerly(no_leaks):
    run = no_leaks / "run"
    summary = run_up(
        run, "--nodes", "1", "--slots-per-node", "2", "--steps", "4", "--warm-fill", "eager"
    )
    assert summary["_rc"] == 0, summary["_stderr"][-4000:]
    lines = (run / "logs" / "agent-node-0.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    starts = [r for r in records if r.get("event") == "rank started"]
    assert [(r["generation"], r["warm"]) for r in starts] == [(1, True), (1, True)], starts
