"""The checkpoint commit's durability and retention, in-process on a one-rank gloo group:
DCP fsyncs the shard files and ``.metadata`` itself (the ``SummingWriter`` it writes
through is its FileSystemWriter with ``sync_files=True``), the commit fsyncs only what
DCP does not (``ledger.json`` and the directory entries around the rename), and
retention deletes what it removes off the training thread, with ``wait`` waiting for the
deletions."""

import os
import shutil
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager

from tests.unit.trainer.runtimes import one_rank as runtime
from trainer import checkpoint_dir
from trainer.checkpoint import Checkpointer
from trainer.ledger import Ledger
from trainer.summing_writer import SummingWriter

pytestmark = pytest.mark.timeout(120)


def entries(directory) -> list[str]:
    """What the checkpoint directory holds, but for its generation fence."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".fence"))


def model_state(step: int) -> dict:
    return {
        "model": {"w": torch.full((64,), float(step)), "b": torch.arange(8.0)},
        "step": torch.tensor(step),
    }


def test_the_summing_writer_syncs_files(tmp_path):
    # The commit relies on DCP's writer fsyncing the files it writes.
    assert SummingWriter(str(tmp_path)).sync_files is True


@pytest.mark.parametrize("use_async", [False, True])
def test_commit_leaves_every_file_and_entry_durable(
    tmp_path, monkeypatch, one_rank_group, use_async
):
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    ckpt = tmp_path / "ckpt"
    saver = Checkpointer(str(ckpt), runtime(), use_async=use_async, keep=0, restored_from=None)
    saver.save(
        5, 80, model_state(5), Ledger([[step, (step - 1) * 16, 16] for step in range(1, 6)]), 16
    )
    saver.wait()

    final = ckpt / "step_00000005"
    staging = checkpoint_dir.staging_path(str(ckpt), 5, 2)
    files = sorted(path.name for path in final.iterdir())
    assert files == [".metadata", "__0_0.distcp", "ledger.json", "manifest.json"]
    synced = [path for kind, path in events if kind == "fsync"]
    # Each file fsynced exactly once, under the name it was written as (DCP writes
    # .metadata.tmp and renames it inside the staging directory).
    for name, written_as in (
        (".metadata", ".metadata.tmp"),
        ("__0_0.distcp", "__0_0.distcp"),
        ("ledger.json", "ledger.json"),
        ("manifest.json", "manifest.json"),
    ):
        assert synced.count(os.path.join(staging, written_as)) == 1, (name, events)
    commit = events.index(("rename", f"{staging} -> {final}"))
    # The staging directory (its entries) before the rename, the parent after it.
    assert ("fsync", staging) in events[:commit]
    assert ("fsync", str(ckpt)) in events[commit:]
    assert checkpoint_dir.committed_steps(str(ckpt)) == {5: str(final)}


def test_retention_deletes_off_the_training_thread_and_wait_waits(
    tmp_path, monkeypatch, one_rank_group
):
    release = threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        if ".expired." in os.fspath(path) and not kwargs.get("ignore_errors"):
            assert release.wait(30), "the test never released the deletion"
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    ckpt = tmp_path / "ckpt"
    saver = Checkpointer(str(ckpt), runtime(), use_async=False, keep=1, restored_from=None)
    for step in (1, 2):
        saver.save(step, step * 16, model_state(step), Ledger(), 16)
    # Step 1 expired with step 2's commit: renamed aside at once (never loaded again),
    # deleted in the background, which is still held up, yet save returned.
    doomed = ckpt / ".step_00000001.g2.expired.tmp"
    assert entries(ckpt) == [doomed.name, "step_00000002"]
    assert checkpoint_dir.committed_steps(str(ckpt)) == {2: str(ckpt / "step_00000002")}

    release.set()
    saver.wait()
    assert entries(ckpt) == ["step_00000002"]


def test_a_failed_deletion_fails_wait(tmp_path, monkeypatch, one_rank_group):
    real_rmtree = shutil.rmtree

    def failing_rmtree(path, *args, **kwargs):
        if ".expired." in os.fspath(path) and not kwargs.get("ignore_errors"):
            raise PermissionError(f"cannot delete {path}")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", failing_rmtree)
    ckpt = tmp_path / "ckpt"
    saver = Checkpointer(str(ckpt), runtime(), use_async=False, keep=1, restored_from=None)
    saver.save(1, 16, model_state(1), Ledger(), 16)
    saver.save(2, 32, model_state(2), Ledger(), 16)
    with pytest.raises(PermissionError, match="cannot delete"):
        saver.wait()


def test_an_async_save_holds_the_state_as_it_was_though_the_next_step_changes_it(
    tmp_path, monkeypatch, one_rank_group
):
    # The staging copy runs beside the next step; it is made slow here, so that an
    # optimizer step that did not wait for it would change what it copies.
    real_stage = DefaultStager._stage
    started = threading.Event()

    def slow_stage(self, state_dict, **kwargs):
        started.set()
        time.sleep(0.5)
        return real_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow_stage)
    ckpt = tmp_path / "ckpt"
    saver = Checkpointer(str(ckpt), runtime(), use_async=True, keep=0, restored_from=None)
    state = model_state(5)
    saver.save(5, 80, state, Ledger([[step, (step - 1) * 16, 16] for step in range(1, 6)]), 16)
    assert started.wait(10)
    assert saver.take_blocked_s() < 0.5  # save returned before the copy ended
    saver.before_update()  # the optimizer step comes next
    assert saver.take_update_wait_s() > 0
    state["model"]["w"].add_(100.0)  # what the optimizer step does, in place
    state["step"].fill_(99)
    saver.wait()

    loaded = {"model": {"w": torch.zeros(64), "b": torch.zeros(8)}, "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=str(ckpt / "step_00000005"))
    assert torch.equal(loaded["model"]["w"], torch.full((64,), 5.0))
    assert int(loaded["step"]) == 5
    # Nothing left to wait for: the next step's call returns at once.
    saver.before_update()
    assert saver.take_update_wait_s() == 0.0
