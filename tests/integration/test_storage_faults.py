"""Storage faults on real filesystems with real processes: a checkpoint filesystem (a
small tmpfs) that is full, by space and then by inodes, while the reference trainer
runs; one rank whose writes fail while its peers' succeed; a filesystem that leftovers
filled before a generation starts; and an old rank 0 stopped while it holds the fence
lock.

Each mounts what it needs (root only) and unmounts it on the way out, however the test
ended."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from protos import keel_pb2
from tests.conftest import (
    REPO,
    AgentRecorder,
    committed_steps,
    local_agent,
    step_losses,
    torchrun,
    wait_for,
)
from trainer import fence

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

SCRIPTS = REPO / "tests" / "integration" / "scripts"
SAVE_FAILED = keel_pb2.CHECKPOINT_PROBLEM_KIND_SAVE_FAILED


@contextlib.contextmanager
def tmpfs(path: Path, **options: object):
    """A tmpfs mounted at ``path`` (``options``: size, nr_inodes), unmounted after."""
    path.mkdir(parents=True)
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            ",".join(f"{key}={value}" for key, value in options.items()),
            "tmpfs",
            str(path),
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        # Lazily if something still holds a file there: the mount must not outlive us.
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True, capture_output=True)


def fill(path: Path, leave_bytes: int = 0) -> None:
    """Writes ``path`` until its filesystem has no free block, then gives back
    ``leave_bytes``."""
    with open(path, "ab", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while out.write(b"\0" * chunk):
                    pass
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
    assert os.statvfs(path).f_bavail == 0
    if leave_bytes:
        os.truncate(path, path.stat().st_size - leave_bytes)


def use_inodes(directory: Path, leave: int) -> list[Path]:
    """Empty files in ``directory`` until its filesystem has ``leave`` inodes free."""
    made = []
    while os.statvfs(directory).f_ffree > leave:
        made.append(directory / f"inode-{len(made)}")
        made[-1].touch()
    return made


def keel_env(socket_path: str, recorder: AgentRecorder, ckpt: Path, generation: int, world: int):
    return {
        "KEEL_CHECKPOINT_DIR": str(ckpt),
        "KEEL_AGENT_SOCKET": socket_path,
        "KEEL_JOB": "demo",
        "KEEL_GENERATION": str(generation),
        "KEEL_NODE": "node-new",
        "KEEL_RANK_TOKEN": recorder.token_for(generation, world, ckpt),
        "KEEL_PREFLIGHT": "0",
    }


class FreesSpace(AgentRecorder):
    """An agent whose operator mends the filesystem when told a save failed: the space
    filler goes after the first failure. After the first commit it uses up the
    filesystem's inodes but one fewer than that checkpoint took, so that the next
    save's last file, the manifest its commit writes, finds none; the inodes come back
    when that save fails. Its callbacks run before the rank's report returns, and the
    next save waits for that report, so each fix lands before the next save."""

    def __init__(self, ckpt: Path, filler: Path):
        super().__init__()
        self.ckpt, self.filler, self.inodes = ckpt, filler, []

    def on_problem(self, problem):
        super().on_problem(problem)
        self.filler.unlink(missing_ok=True)
        for path in self.inodes:
            path.unlink()
        self.inodes = []

    def on_checkpoint(self, saved):
        super().on_checkpoint(saved)
        if len(self.of("checkpoint")) == 1:
            took = 1 + len(os.listdir(saved.path))  # its directory and each file
            self.inodes = use_inodes(self.ckpt, leave=took - 1)


def test_a_full_filesystem_fails_saves_training_goes_on_and_the_next_save_commits(tmp_path):
    with tmpfs(tmp_path / "ckpt", size="16m", nr_inodes=256) as ckpt:
        # The directory was claimed by an earlier start of this generation; then the
        # filesystem filled up, but for 64 KiB: room for a ledger, not for a shard.
        fence.claim(str(ckpt), 3, timeout_s=10)
        filler = ckpt / "filler"
        fill(filler, leave_bytes=64 * 1024)
        recorder = FreesSpace(ckpt, filler)
        with local_agent(recorder) as socket_path:
            run = torchrun(
                2,
                "-m",
                "trainer.train",
                "--steps",
                "8",
                "--checkpoint-every",
                "2",
                "--keep-checkpoints",
                "0",
                env=keel_env(socket_path, recorder, ckpt, generation=3, world=2),
            )
        losses = step_losses(run)
        assert sorted(losses) == list(range(1, 9)), "training did not go on to its end"
        # Step 2's shards found no space, step 6's manifest no inode: each skipped, its
        # staging directory gone; 4 and 8, after the operator's fixes, committed.
        assert committed_steps(ckpt) == [4, 8]
        assert not [path.name for path in ckpt.iterdir() if path.name.endswith(".tmp")]
        assert [c.step for c in recorder.of("checkpoint")] == [4, 8]
        problems = recorder.of("problem")
        assert [(p.generation, p.step, p.kind) for p in problems] == [
            (3, 2, SAVE_FAILED),
            (3, 6, SAVE_FAILED),
        ]
        assert problems[0].reason.startswith("the save of step 2 failed: "), problems[0].reason
        assert "on ranks 0, 1" in problems[0].reason, problems[0].reason
        assert "No space left on device" in problems[1].reason, problems[1].reason
        assert "manifest.json" in problems[1].reason, "the commit did not fail"
        for step in (2, 6):
            assert run.stderr.count(f"checkpoint of step {step} not saved") == 1, run.stderr


def test_under_keel_up_a_failed_save_is_an_event_and_the_run_goes_on(no_leaks):
    workdir = no_leaks / "run"
    rank0 = workdir / "nodes" / "node-0" / "keel-up" / "gen1" / "rank0.err"
    with tmpfs(workdir / "checkpoints", size="16m") as ckpt:
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "up",
                "--json",
                "--workdir",
                str(workdir),
                "--nodes",
                "1",
                "--slots-per-node",
                "1",
                "--steps",
                "12",
                "--checkpoint-every",
                "4",
                # Paced (steps 5 times their compute), so that the operator's fix below
                # lands well before the last save.
                "--inject",
                "slow:rank=0,step=1,factor=5",
                "--timeout-s",
                "240",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            # The generation claims the directory; then the disk fills up but for 64 KiB.
            wait_for(lambda: (ckpt / ".fence").exists() or up.poll() is not None, 120, what="claim")
            filler = ckpt / "filler"
            fill(filler, leave_bytes=64 * 1024)
            wait_for(
                lambda: "checkpoint of step 4 not saved" in text_of(rank0) or up.poll() is not None,
                120,
                what="a failed save",
            )
            filler.unlink()  # the operator frees space
            out, err = up.communicate(timeout=300)
        finally:
            if up.poll() is None:
                up.kill()
                up.communicate()
        summary = json.loads(out)
        assert (summary["state"], summary["steps"], summary["restarts"]) == ("SUCCEEDED", 12, 0), (
            err
        )
        assert summary["last_checkpoint"]["step"] == 12
        failed = [e for e in summary["events"] if e["kind"] == "checkpoint_failed"]
        assert failed and failed[0]["step"] == 4, summary["events"]
        assert "the save of step 4 failed: " in failed[0]["reason"], failed[0]
        assert "training went on" in failed[0]["reason"], failed[0]
        assert all(e["step"] < 12 for e in failed), failed


def text_of(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_rank_whose_write_fails_alone_fails_the_save_on_every_rank(tmp_path, agent):
    socket_path, recorder = agent
    ckpt = tmp_path / "ckpt"
    run = torchrun(
        2,
        str(SCRIPTS / "one_rank_cannot_write.py"),
        str(ckpt),
        "3",
        "1",
        "2",
        env=keel_env(socket_path, recorder, ckpt, generation=2, world=2),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    went_on = sorted((json.loads(line) for line in run.stdout.splitlines()), key=str)
    assert went_on == [{"rank": 0, "steps": [1, 2, 3]}, {"rank": 1, "steps": [1, 2, 3]}]
    # Rank 0 wrote its shard of step 2; DCP's collective save failed it on both ranks
    # all the same, and rank 0 removed it.
    assert committed_steps(ckpt) == [1, 3]
    assert not [path.name for path in ckpt.iterdir() if path.name.endswith(".tmp")]
    (problem,) = recorder.of("problem")
    assert (problem.step, problem.kind) == (2, SAVE_FAILED)
    assert "on rank 1: " in problem.reason and "on ranks" not in problem.reason, problem.reason


def test_a_filesystem_full_of_leftovers_is_cleaned_before_the_start_writes(tmp_path):
    with tmpfs(tmp_path / "ckpt", size="4m") as ckpt:
        # Generation 1 died mid-save and mid-delete, and its leftovers filled the disk.
        fence.claim(str(ckpt), 1, timeout_s=10)
        for name in (".step_00000002.g1.expired.tmp", ".step_00000004.g1.tmp"):
            (ckpt / name).mkdir()
        (ckpt / ".step_00000002.g1.expired.tmp" / "__0_0.distcp").write_bytes(b"\0" * (1 << 20))
        fill(ckpt / ".step_00000004.g1.tmp" / "__0_0.distcp")
        run = torchrun(
            1,
            "-m",
            "trainer.train",
            "--steps",
            "2",
            "--checkpoint-every",
            "2",
            env={"KEEL_CHECKPOINT_DIR": str(ckpt), "KEEL_GENERATION": "2"},
        )
        assert sorted(step_losses(run)) == [1, 2]
        for name in (".step_00000002.g1.expired.tmp", ".step_00000004.g1.tmp"):
            assert f"removed {name}, left by a rank that died while saving" in run.stderr
        assert fence.owner(str(ckpt)) == 2
        assert committed_steps(ckpt) == [2]
        assert not [path.name for path in ckpt.iterdir() if path.name.endswith(".tmp")]


def test_a_stalled_old_rank_0_holding_the_fence_fails_the_start_naming_it(tmp_path, agent):
    socket_path, recorder = agent
    ckpt = tmp_path / "ckpt"
    fence.claim(str(ckpt), 1, timeout_s=10)
    out = tmp_path / "holder.out"
    with open(out, "wb") as log:
        holder = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "hold_fence.py"), str(ckpt)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "KEEL_GENERATION": "1",
                "KEEL_NODE": "node-old",
            },
        )
    try:
        wait_for(lambda: b"held" in out.read_bytes() or holder.poll() is not None, 60, what="lock")
        assert holder.poll() is None, out.read_text()
        holder.send_signal(signal.SIGSTOP)
        # Its first-step budget (2 s), through the job's deadline chain as an agent
        # sets it, gives the fence lock 1 s.
        env = keel_env(socket_path, recorder, ckpt, generation=2, world=1)
        env.update(
            KEEL_HANG_FLOOR_S="1",
            KEEL_FIRST_STEP_TIMEOUT_S="2",
            KEEL_CHECKPOINT_TIMEOUT_S="2",
            KEEL_STOP_GRACE_S="1",
        )
        run = torchrun(1, "-m", "trainer.train", "--steps", "2", env=env)
        assert run.returncode != 0, "the new generation started under a held fence"
        named = f"held for over 1 s by pid {holder.pid} on node node-old (generation 1)"
        assert f"FenceTimeout: the fence lock {ckpt / fence.LOCK_FILE} was {named}" in run.stderr
        assert not step_losses(run, check=False), "a step ran without the fence"
        (problem,) = recorder.of("problem")
        assert (problem.generation, problem.kind, problem.suspect_node, problem.path) == (
            2,
            keel_pb2.CHECKPOINT_PROBLEM_KIND_FENCE_TIMEOUT,
            "node-old",
            str(ckpt),
        )
        assert named in problem.reason
        assert fence.owner(str(ckpt)) == 1, "the claim went through the held lock"
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(30)
    # Once its holder is gone, the lock is free.
    fence.claim(str(ckpt), 2, timeout_s=10, node="node-new")
    assert fence.owner(str(ckpt)) == 2
