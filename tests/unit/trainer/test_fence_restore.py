"""Generation fences on the checkpoint directory, checkpoint manifests, and the choice
of what to restore: in-process, on a one-rank gloo group."""

import os
import threading

import pytest

from tests.unit.trainer.runtimes import one_rank as runtime
from tests.unit.trainer.test_checkpoint_commit import model_state
from trainer import fence, manifest, restore
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_dir import committed_path
from trainer.ledger import Ledger

pytestmark = pytest.mark.timeout(120)


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
    assert chosen == restore.Restored(older, (), resumed=False)
    assert not os.path.exists(newest)
    assert os.path.isdir(os.path.join(directory, ".quarantine.step_00000010.g3"))
    logged = capsys.readouterr().err
    assert f"quarantined checkpoint {newest}: __0_0.distcp does not match its checksum" in logged
    # Under plain torchrun: the committed ones, newest first, with the same checks.
    assert restore.choose(directory, runtime(0)).path == older
    # Nothing that verifies, where there were candidates: no silent fresh start.
    corrupt(older)
    with pytest.raises(restore.NothingToRestore, match="^no verifiable checkpoint: .*step_0+5"):
        restore.choose(directory, runtime(4, job="j", restore_from=older))
    # A fresh start is what the controller asks for with no restore point.
    assert restore.choose(directory, runtime(5, job="j")) is None


def test_a_checkpoint_this_node_cannot_read_is_left_alone_and_one_without_manifest_loads(
    tmp_path, one_rank_group, capsys
):
    directory = str(tmp_path / "ckpt")
    save(directory, 2, [5, 10])
    newest, older = committed_path(directory, 10), committed_path(directory, 5)
    # The newest is not there on this node (a mount missing): not damage.
    os.rename(newest, str(tmp_path / "elsewhere"))
    os.remove(os.path.join(older, manifest.MANIFEST_FILE))  # written before manifests
    chosen = restore.choose(directory, runtime(3, job="j", restore_from=newest, fallbacks=[older]))
    assert chosen.path == older
    logged = capsys.readouterr().err
    assert f"cannot read checkpoint {newest} here; leaving it as it is" in logged
    assert f"restoring {older} without a checksum manifest" in logged
    assert not [n for n in os.listdir(directory) if n.startswith(".quarantine")]
    # Nothing readable on this node: it says so, for the job to try another node.
    with pytest.raises(restore.CheckpointUnreachable, match="no verifiable checkpoint: "):
        restore.choose(directory, runtime(4, job="j", restore_from=newest))


def test_a_resume_source_is_read_and_never_changed(tmp_path, one_rank_group, capsys):
    source = str(tmp_path / "theirs")
    save(source, 7, [5, 10])
    corrupt(committed_path(source, 10))
    before = sorted(os.listdir(source))
    # A directory: its newest verifiable checkpoint; the damaged one stays where it is.
    chosen = restore.choose(str(tmp_path / "mine"), runtime(1, job="j", resume_from=source))
    assert chosen == restore.Restored(committed_path(source, 5), (), resumed=True)
    assert sorted(os.listdir(source)) == before
    assert f"cannot restore checkpoint {committed_path(source, 10)}" in capsys.readouterr().err
    # One checkpoint named: that one.
    named = runtime(1, job="j", resume_from=committed_path(source, 5))
    assert restore.choose(str(tmp_path / "mine"), named).path == committed_path(source, 5)
    # Once the job recorded its own, those come first and the source is not looked at.
    mine = str(tmp_path / "mine")
    save(mine, 1, [12])
    own = runtime(2, job="j", restore_from=committed_path(mine, 12), resume_from=source)
    assert restore.choose(mine, own) == restore.Restored(committed_path(mine, 12), (), False)
    # A source with nothing to resume from is no fresh start.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(restore.NothingToRestore, match=f"to resume from in {empty}: it holds"):
        restore.choose(mine, runtime(3, job="j", resume_from=str(empty)))
    with pytest.raises(restore.CheckpointUnreachable, match="cannot be read here"):
        restore.choose(mine, runtime(3, job="j", resume_from=str(tmp_path / "absent")))


def test_the_fence_names_its_job_and_another_lineage_is_refused(tmp_path):
    directory = str(tmp_path)
    mine = fence.Owner(2, "id-mine", "train", ("id-origin", "id-mine"))
    fence.claim(directory, 2, mine, timeout_s=10)
    assert fence.read_owner(directory) == mine
    with fence.held(directory, 2, "id-mine", timeout_s=10):
        pass
    # A later generation of the same job keeps its name and lineage.
    with fence.held(directory, 3, "id-mine", timeout_s=10):
        pass
    assert fence.read_owner(directory) == fence.Owner(3, "id-mine", "train", mine.lineage)
    # Another job took the directory over (it held none of its checkpoints): the first
    # job's steps are refused, whatever their generation numbers.
    fence.claim(directory, 1, fence.Owner(1, "id-theirs", "other", ("id-theirs",)), timeout_s=10)
    with pytest.raises(fence.ForeignLineage, match="job other \\(id id-theirs"):
        with fence.held(directory, 9, "id-mine", timeout_s=10):
            pytest.fail("a step of a lineage that no longer owns the directory ran")
    # A fence from before fences named their job is adopted by the job's claim.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / fence.FENCE_FILE).write_text('{"generation": 7}')
    fence.claim(str(legacy), 1, fence.Owner(1, "id-mine", "train", ("id-mine",)), timeout_s=10)
    assert fence.read_owner(str(legacy)).job_id == "id-mine"
