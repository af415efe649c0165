"""Generation fences on the checkpoint directory, checkpoint manifests, and the choice
of what to restore: in-process, on a one-rank gloo group."""

import os
import threading

import pytest

from protos import keel_pb2
from tests.unit.trainer.test_checkpoint_commit import model_state
from trainer import fence, manifest, restore
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_dir import committed_path
from trainer.ledger import Ledger
from trainer.runtime import Identity, Runtime

pytestmark = pytest.mark.timeout(120)


def runtime(generation=2, job="", restore_from=None, fallbacks=()) -> Runtime:
    return Runtime(
        Identity(
            rank=0,
            world_size=1,
            local_rank=0,
            generation=generation,
            job=job,
            mesh={"dp_shard": 1},
            checkpoint_dir=None,
            restore_from=restore_from,
            restart_count=0,
            agent_socket=None,
            restore_fallbacks=tuple(fallbacks),
        ),
        faults=keel_pb2.FaultSchedule(),
    )


def test_a_newer_generation_fences_an_older_one_out(tmp_path):
    directory = str(tmp_path)
    fence.claim(directory, 3, timeout_s=10)
    with fence.held(directory, 3, timeout_s=10):
        pass
    fence.claim(directory, 4, timeout_s=10)
    with pytest.raises(fence.Superseded, match="generation 4 owns") as refused:
        with fence.held(directory, 3, timeout_s=10):
            pytest.fail("a superseded generation's step ran")
    assert refused.value.owner == 4 and fence.owner(directory) == 4
    with pytest.raises(fence.Superseded):
        fence.claim(directory, 3, timeout_s=10)
    # Outside Keel there is no fence.
    with fence.held(directory, 0, timeout_s=10):
        pass


def test_a_claim_waits_for_a_step_in_progress(tmp_path):
    directory = str(tmp_path)
    fence.claim(directory, 1, timeout_s=10)
    inside, release, claimed = threading.Event(), threading.Event(), threading.Event()

    def old_step():
        with fence.held(directory, 1, timeout_s=10):
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=old_step)
    worker.start()
    inside.wait(10)
    newer = threading.Thread(
        target=lambda: (fence.claim(directory, 2, timeout_s=10), claimed.set())
    )
    newer.start()
    # While generation 1's step holds the lock, generation 2 cannot take the directory.
    assert not claimed.wait(0.3) and fence.owner(directory) == 1
    release.set()
    worker.join(10)
    assert claimed.wait(10) and fence.owner(directory) == 2
    newer.join(10)


def test_a_manifest_catches_missing_truncated_and_damaged_files(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 5000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 10)
    manifest.write(str(tmp_path), 7)
    assert manifest.verify(str(tmp_path)) == ""
    (tmp_path / "a.distcp").write_bytes(b"x" * 4999 + b"z")
    assert manifest.verify(str(tmp_path)) == "a.distcp does not match its checksum"
    (tmp_path / "a.distcp").write_bytes(b"x" * 10)
    assert manifest.verify(str(tmp_path)) == "a.distcp has 10 bytes, the manifest says 5000"
    (tmp_path / "a.distcp").unlink()
    assert manifest.verify(str(tmp_path)) == "a.distcp is missing"
    (tmp_path / manifest.MANIFEST_FILE).unlink()
    assert manifest.verify(str(tmp_path)) == "it has no manifest.json"
    assert manifest.verify(str(tmp_path / "gone")) == "the directory is missing"


def save(directory, generation, steps, keep=0):
    saver = Checkpointer(
        directory, runtime(generation), use_async=False, keep=keep, restored_from=None
    )
    for step in steps:
        saver.save(step, step * 16, model_state(step), Ledger(), 16)
    saver.wait()


def test_a_superseded_generation_can_neither_commit_nor_clean_up(tmp_path, one_rank_group, capsys):
    directory = str(tmp_path / "ckpt")
    save(directory, 2, [1])
    fence.claim(directory, 3, timeout_s=10)  # generation 3 took over the directory
    saver = Checkpointer(directory, runtime(2), use_async=True, keep=1, restored_from=None)
    with pytest.raises(fence.Superseded):
        saver.save(2, 32, model_state(2), Ledger(), 16)
        saver.wait()
    assert not os.path.exists(committed_path(directory, 2))
    assert os.path.isdir(committed_path(directory, 1)), "its retention deleted nothing"
    assert "refusing to change checkpoint step 2: generation 3 owns" in capsys.readouterr().err


def corrupt(path):
    shard = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))


def test_a_damaged_newest_checkpoint_is_quarantined_and_the_one_before_restored(
    tmp_path, one_rank_group, capsys
):
    directory = str(tmp_path / "ckpt")
    save(directory, 2, [5, 10])
    newest, older = committed_path(directory, 10), committed_path(directory, 5)
    corrupt(newest)
    # Under Keel: the controller's restore point, then its fallbacks.
    chosen = restore.choose(directory, runtime(3, job="j", restore_from=newest, fallbacks=[older]))
    assert chosen == older
    assert not os.path.exists(newest)
    assert os.path.isdir(os.path.join(directory, ".quarantine.step_00000010.g3"))
    logged = capsys.readouterr().err
    assert f"quarantined checkpoint {newest}: __0_0.distcp does not match its checksum" in logged
    # Under plain torchrun: the committed ones, newest first, with the same checks.
    assert restore.choose(directory, runtime(0)) == older
    # Nothing that verifies, where there were candidates: no silent fresh start.
    corrupt(older)
    with pytest.raises(restore.NothingToRestore, match="no checkpoint can be restored"):
        restore.choose(directory, runtime(4, job="j", restore_from=older))
    # A fresh start is what the controller asks for with no restore point.
    assert restore.choose(directory, runtime(5, job="j")) is None
