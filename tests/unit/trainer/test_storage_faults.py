"""Storage faults in the checkpoint directory, in-process: a save whose write fails on
the filesystem is skipped and training goes on (a real EFBIG: the process's file-size
limit, which fails a write the way a full disk does); which errors count as storage
faults; the fence lock's deadline and the holder it names; the start's cleanup before
the claim. The same faults with real filesystems and processes are in
tests/integration/test_storage_faults.py."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import threading
import traceback
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from protos import keel_pb2
from tests.unit.trainer.runtimes import one_rank as runtime
from trainer import checkpoint_dir, fence
from trainer.checkpoint import Checkpointer, delete_removed
from trainer.ledger import Ledger
from trainer.runtime import Runtime, fence_timeout_s, init
from trainer.storage_faults import StorageFault, storage_fault

pytestmark = pytest.mark.timeout(120)


class Reported(Runtime):
    """A Runtime without an agent that keeps the checkpoint problems it would send."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.problems: list[tuple] = []

    def report_checkpoint_problem(self, step, path, kind, reason, *, suspect_node=""):
        self.problems.append((step, path, kind, reason, suspect_node))
        return True


@contextlib.contextmanager
def file_size_limit(limit_bytes: int):
    """No file of this process may grow past ``limit_bytes`` (RLIMIT_FSIZE): a write past
    it fails with EFBIG, as one on a full disk fails with ENOSPC. SIGXFSZ, which would
    end the process, is ignored meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def big_state(step: int) -> dict:
    """A state whose shard (400 KB) is far over the limit the test sets, and whose
    ledger and fence files are far under it."""
    return {"model": {"w": torch.full((100_000,), float(step))}, "step": torch.tensor(step)}


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("use_async", [False, True])
def test_a_save_that_fails_on_storage_is_skipped_and_the_next_one_commits(
    tmp_path, one_rank_group, capsys, use_async
):
    ckpt = tmp_path / "ckpt"
    rt = Reported(runtime(2).identity, keel_pb2.FaultSchedule())
    saver = Checkpointer(str(ckpt), rt, use_async=use_async, keep=0, restored_from=None)
    saver.save(1, 16, big_state(1), Ledger(), 16)
    saver.wait()
    with file_size_limit(64 * 1024):
        saver.save(2, 32, big_state(2), Ledger(), 16)
        saver.poll()
        saver.wait()  # neither raises: training goes on
    saver.save(3, 48, big_state(3), Ledger(), 16)
    saver.wait()

    assert sorted(checkpoint_dir.committed_steps(str(ckpt))) == [1, 3]
    assert leftovers(ckpt) == [], "the failed save's staging directory is left"
    (problem,) = rt.problems
    step, path, kind, reason, suspect = problem
    assert (step, path, kind, suspect) == (
        2,
        checkpoint_dir.staging_path(str(ckpt), 2, 2),
        "save_failed",
        "",
    )
    # DCP writes the shard through torch's zip writer, which says nothing of EFBIG.
    assert reason.startswith("the save of step 2 failed: RuntimeError on rank 0: "), reason
    assert "inline_container.cc" in reason and "no space, a quota, an I/O error" in reason
    logged = capsys.readouterr().err
    assert logged.count("checkpoint of step 2 not saved") == 1, logged
    assert "training goes on, the next save is tried on schedule" in logged


def test_a_storage_fault_is_an_oserror_under_the_save_on_every_rank_dcp_names():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/.step_00000002.g2.tmp/x")
    assert storage_fault(full) == StorageFault(full)
    try:
        try:
            raise full
        except OSError as error:
            raise RuntimeError("the write failed") from error
    except RuntimeError as wrapped:
        assert storage_fault(wrapped).error is full
    stack = traceback.StackSummary()
    # DCP's collective save: every rank gets the coordinator's gathered failures.
    gathered = CheckpointException("write", {1: (full, stack)})
    assert str(storage_fault(gathered)) == (
        "OSError on rank 1: [Errno 28] No space left on device: '/ckpt/.step_00000002.g2.tmp/x'"
    )
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert storage_fault(CheckpointException("write", {0: (full, stack), 3: (quota, stack)})) == (
        StorageFault(full, (0, 3))
    )
    # torch's zip writer loses the OSError of a short write and says so in its own words.
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert storage_fault(CheckpointException("write", {0: (short, stack)})) == StorageFault(
        short, (0,)
    )
    assert "no space, a quota, an I/O error" in str(StorageFault(short, (0,)))
    # Anything else fails the rank: a bug on any rank, a refusal, a stalled fence.
    assert storage_fault(RuntimeError("a bug in a planner")) is None
    assert (
        storage_fault(CheckpointException("write", {0: (full, stack), 1: (ValueError(), stack)}))
        is None
    )
    assert storage_fault(ValueError("a bug")) is None
    try:
        raise fence.Superseded("/ckpt", 2, 3) from full
    except fence.Superseded as refused:
        assert storage_fault(refused) is None
    assert storage_fault(fence.FenceTimeout("/ckpt", 1.0, None)) is None


def test_a_lock_held_past_the_deadline_names_its_holder(tmp_path):
    directory = str(tmp_path)
    inside, release = threading.Event(), threading.Event()

    def stalled_old_rank():
        with fence.held(directory, 1, timeout_s=10, node="node-old"):
            inside.set()
            release.wait(30)

    old = threading.Thread(target=stalled_old_rank)
    old.start()
    try:
        assert inside.wait(10)
        with pytest.raises(fence.FenceTimeout) as stalled:
            fence.claim(directory, 2, timeout_s=0.2, node="node-new")
        assert (stalled.value.pid, stalled.value.node) == (os.getpid(), "node-old")
        assert stalled.value.holder == fence.Holder(os.getpid(), "node-old", 1)
        assert f"held for over 0.2 s by pid {os.getpid()} on node node-old (generation 1)" in str(
            stalled.value
        )
        assert isinstance(stalled.value, TimeoutError)
        assert fence.owner(directory) == 1
    finally:
        release.set()
        old.join(10)
    fence.claim(directory, 2, timeout_s=10, node="node-new")
    assert fence.owner(directory) == 2
    assert fence.holder(directory) == fence.Holder(os.getpid(), "node-new", 2)


def test_the_holder_record_reads_back_and_nothing_else_reads_as_one():
    who = fence.Holder(4242, "node-7", 9)
    data = who.to_bytes()
    assert len(data) == fence.HOLDER_BYTES and fence.Holder.parse(data) == who
    for garbage in (b"", b"{", b"[]", b'{"schema": 2, "pid": 1, "node": "", "generation": 1}'):
        assert fence.Holder.parse(garbage) is None
    unknown = fence.FenceTimeout("/ckpt", 3.0, None)
    assert (unknown.pid, unknown.node) == (0, "")
    assert "a process that did not say who it is" in str(unknown)


def test_the_start_removes_leftovers_only_as_the_owner_and_claims_after(tmp_path):
    ckpt = tmp_path / "ckpt"
    fence.claim(str(ckpt), 3, timeout_s=10)
    for name in (".step_00000010.g3.tmp", ".step_00000005.g3.expired.tmp"):
        (ckpt / name).mkdir()
        (ckpt / name / "__0_0.distcp").write_bytes(b"x" * 1000)
    (ckpt / "step_00000004").mkdir()
    # A superseded generation is refused before it removes anything.
    with pytest.raises(fence.Superseded):
        checkpoint_dir.discard_staging(str(ckpt), 2, fence_timeout_s=10)
    assert leftovers(ckpt) == [".step_00000005.g3.expired.tmp", ".step_00000010.g3.tmp"]
    assert fence.owner(str(ckpt)) == 3
    removed = checkpoint_dir.discard_staging(str(ckpt), 4, fence_timeout_s=10, node="node-1")
    assert removed == [".step_00000005.g3.expired.tmp", ".step_00000010.g3.tmp"]
    assert leftovers(ckpt) == [] and (ckpt / "step_00000004").is_dir()
    assert fence.owner(str(ckpt)) == 4
    # Outside Keel: no fence, and no directory until the first save.
    assert checkpoint_dir.discard_staging(str(tmp_path / "none"), 0, fence_timeout_s=10) == []
    assert not (tmp_path / "none").exists()


def test_the_fence_deadline_is_half_the_shorter_budget_of_the_first_step_and_a_save():
    assert fence_timeout_s({}) == 150.0  # common.deadlines' defaults: 300 s each
    assert fence_timeout_s({"KEEL_FIRST_STEP_TIMEOUT_S": "120"}) == 60.0
    assert (
        fence_timeout_s({"KEEL_FIRST_STEP_TIMEOUT_S": "120", "KEEL_CHECKPOINT_TIMEOUT_S": "40"})
        == 20.0
    )
    rt = init({"KEEL_GENERATION": "2", "KEEL_NODE": "node-3", "KEEL_FIRST_STEP_TIMEOUT_S": "8"})
    assert (rt.fence_timeout_s, rt.node) == (4.0, "node-3")
    with pytest.raises(ValueError, match="KEEL_FIRST_STEP_TIMEOUT_S"):
        fence_timeout_s({"KEEL_FIRST_STEP_TIMEOUT_S": "soon"})


def test_a_problem_reaches_the_agent_with_the_node_it_suspects(agent):
    socket_path, recorder = agent
    rt = init(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "KEEL_JOB": "demo",
            "KEEL_GENERATION": "4",
            "KEEL_AGENT_SOCKET": socket_path,
            "KEEL_RANK_TOKEN": recorder.token_for(4, 1),
        }
    )
    try:
        assert rt.report_checkpoint_problem(
            0, "/ckpt", "fence_timeout", "held by pid 7 on node node-old", suspect_node="node-old"
        )
    finally:
        rt.close()
    (problem,) = recorder.of("problem")
    assert (problem.generation, problem.kind, problem.suspect_node) == (
        4,
        keel_pb2.CHECKPOINT_PROBLEM_KIND_FENCE_TIMEOUT,
        "node-old",
    )


def test_a_removed_checkpoint_another_generation_deleted_first_is_deleted(tmp_path):
    """A newer generation's cleanup removes every ``.tmp`` directory, a superseded
    generation's renamed checkpoint among them, while that generation's background
    delete walks it: CI saw its rmtree raise FileNotFoundError and end the run. Half
    gone or all gone, it is deleted; a fault of another kind is still raised."""
    doomed = tmp_path / ".step_00000017.g1.expired.tmp"
    (doomed / "inner").mkdir(parents=True)
    (doomed / "inner" / "shard").write_bytes(b"x")
    calls = []
    real_rmdir = os.rmdir

    def raced(path, *args, **kwargs):  # the other deleter gets there in between
        if not calls:
            calls.append(path)
            with mock.patch("os.rmdir", real_rmdir):
                shutil.rmtree(doomed)
        real_rmdir(path, *args, **kwargs)

    with mock.patch("os.rmdir", raced):
        delete_removed(str(doomed))
    assert calls and not doomed.exists()
    delete_removed(str(tmp_path / ".step_00000018.g1.expired.tmp"))  # all gone
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        delete_removed(str(not_a_directory / "x"))
