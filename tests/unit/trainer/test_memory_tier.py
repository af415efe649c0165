"""What a memory snapshot is on disk and when one counts as whole
(``trainer.memory_tier``); the save and the restore run on real ranks in
tests/integration/test_memory_tier.py."""

import pickle
from pathlib import Path
from types import SimpleNamespace

import torch

from trainer.memory_tier import (
    SnapshotInfo,
    committed,
    snapshot_path,
    staging_path,
    state_bytes,
    whole,
)


def stored(path: str, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(relative_path=path, offset=offset, length=length)


def snapshot(root: Path, step: int, files: dict[str, int], needed: dict) -> Path:
    path = Path(snapshot_path(str(root), step))
    path.mkdir(parents=True)
    SnapshotInfo(step, step * 16, "job", ("origin", "job"), 2, 4).write(str(path))
    for name, size in files.items():
        (path / name).write_bytes(b"\0" * size)
    metadata = SimpleNamespace(storage_data=needed)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


def test_a_snapshot_is_whole_only_with_every_file_its_metadata_names_in_full(tmp_path: Path):
    needed = {"a": stored("__0_0.distcp", 0, 60), "b": stored("__0_0.distcp", 60, 40)}
    needed["c"] = stored("__1_0.distcp", 0, 10)
    path = snapshot(tmp_path, 7, {"__0_0.distcp": 100, "__1_0.distcp": 10}, needed)
    info, problem = whole(str(path))
    assert problem == "" and info == SnapshotInfo(7, 112, "job", ("origin", "job"), 2, 4)

    (path / "__0_0.distcp").write_bytes(b"\0" * 99)  # torn mid-copy
    assert whole(str(path)) == (None, f"{path}: __0_0.distcp holds 99 of its 100 bytes")
    (path / "__1_0.distcp").unlink()  # another node's rank's shard
    assert whole(str(path))[1] == f"{path}: __0_0.distcp holds 99 of its 100 bytes"
    (path / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert whole(str(path)) == (None, f"{path}: __1_0.distcp is not on this node")


def test_a_snapshot_without_its_info_or_metadata_is_not_whole(tmp_path: Path):
    path = snapshot(tmp_path, 3, {}, {})
    (path / "snapshot.json").write_text("{not json")
    assert "unreadable (JSONDecodeError" in whole(str(path))[1]
    other = snapshot(tmp_path, 4, {}, {})
    (other / ".metadata").unlink()
    assert "unreadable (FileNotFoundError" in whole(str(other))[1]


def test_only_committed_names_are_snapshots(tmp_path: Path):
    snapshot(tmp_path, 5, {}, {})
    Path(staging_path(str(tmp_path), 6, 3)).mkdir()
    (tmp_path / "mem_7").mkdir()  # not a step's name
    assert committed(str(tmp_path)) == {5: snapshot_path(str(tmp_path), 5)}
    assert committed(str(tmp_path / "absent")) == {} and committed(None) == {}
    assert staging_path("/m", 6, 3) == "/m/.mem_00000006.g3.tmp"


def test_the_budget_counts_the_tensors_a_rank_holds():
    state = {
        "model": {"w": torch.zeros(10, 10), "b": torch.zeros(10, dtype=torch.float16)},
        "trainer": {"step": torch.tensor(3, dtype=torch.int64), "ledger": [[1, 2, 3]]},
        "list": [torch.zeros(4, dtype=torch.int8)],
    }
    assert state_bytes(state) == 400 + 20 + 8 + 4
