"""What a memory snapshot is on disk and when one counts as whole
(``trainer.memory_tier``); the save and the restore run on real ranks in
tests/integration/test_memory_tier.py."""

import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from trainer.memory_tier import (
    Extent,
    SnapshotInfo,
    SnapshotReader,
    _Plan,
    bounded_interval,
    committed,
    files_read,
    snapshot_path,
    staging_path,
    state_bytes,
    whole,
)


def stored(path: str, offset: int, length: int) -> Extent:
    return Extent(path, offset, length, torch.uint8, (length,))


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
    needed = {"a": stored("__0.mem", 0, 60), "b": stored("__0.mem", 60, 40)}
    needed["c"] = stored("__1.mem", 0, 10)
    path = snapshot(tmp_path, 7, {"__0.mem": 100, "__1.mem": 10}, needed)
    info, problem = whole(str(path))
    assert problem == "" and info == SnapshotInfo(7, 112, "job", ("origin", "job"), 2, 4)

    (path / "__0.mem").write_bytes(b"\0" * 99)  # torn mid-copy
    assert whole(str(path)) == (None, f"{path}: __0.mem holds 99 of its 100 bytes")
    (path / "__1.mem").unlink()  # another node's rank's shard: said first
    assert whole(str(path)) == (None, f"{path}: __1.mem is not on this node")
    (path / "__1.mem").write_bytes(b"\0" * 10)
    (path / "__0.mem").write_bytes(b"\0" * 100)
    assert whole(str(path))[1] == ""


def test_a_node_copy_is_whole_with_its_own_ranks_files_and_usable_where_it_holds_the_reads(
    tmp_path: Path,
):
    # Node 1 of a job across two nodes: its copy holds ranks 2 and 3's files; ranks 0
    # and 1's are on node 0.
    needed = {name: stored(f"__{rank}.mem", 0, 10) for rank, name in enumerate("abcd")}
    path = snapshot(tmp_path, 7, {"__2.mem": 10, "__3.mem": 10}, needed)
    info = SnapshotInfo(7, 112, "job", ("origin", "job"), 2, 4, ranks=(2, 3))
    info.write(str(path))
    assert whole(str(path)) == (info, "")
    assert SnapshotInfo.read(str(path)).ranks == (2, 3)
    # A rank restoring the same layout on the same node reads its own files.
    assert whole(str(path), lambda metadata: {"__3.mem"}) == (info, "")
    # One that would read another node's (a layout or a placement changed) cannot.
    assert whole(str(path), lambda metadata: {"__1.mem", "__3.mem"}) == (
        None,
        f"{path}: this rank reads __1.mem, which another node's copy holds (this node's "
        "holds ranks [2, 3]'s files: the layout or the placement changed)",
    )
    (path / "__3.mem").write_bytes(b"\0" * 9)  # the node's own copy, torn
    assert whole(str(path)) == (None, f"{path}: __3.mem holds 9 of its 10 bytes")


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


def objects_file(path: Path, objects: dict) -> None:
    payload = pickle.dumps(objects)
    path.write_bytes(struct.pack("<Q", len(payload)) + payload)


def test_a_rank_s_objects_count_only_framed_in_full_and_with_every_object(tmp_path: Path):
    ledger, lr = MetadataIndex("trainer.ledger"), MetadataIndex("optim.lr")
    needed = {ledger: Extent("__0.obj", 0, 0), lr: Extent("__0.obj", 0, 0)}
    path = snapshot(tmp_path, 2, {}, needed)
    objects_file(path / "__0.obj", {ledger: [[0, 16]], lr: 0.1})
    assert whole(str(path))[1] == ""
    data = (path / "__0.obj").read_bytes()
    (path / "__0.obj").write_bytes(data[:-3])  # torn mid-copy
    assert whole(str(path))[1] == (
        f"{path}: __0.obj holds {len(data) - 11} of its {len(data) - 8} bytes of objects"
    )
    (path / "__0.obj").write_bytes(data[:5])
    assert whole(str(path))[1] == f"{path}: __0.obj is cut short"
    objects_file(path / "__0.obj", {ledger: [[0, 16]]})
    assert whole(str(path))[1] == f"{path}: __0.obj lacks optim.lr"
    (path / "__0.obj").unlink()
    assert whole(str(path))[1] == f"{path}: __0.obj is not on this node"


def test_a_snapshot_is_read_back_through_dcp_as_it_was_written(tmp_path: Path, one_rank_group):
    """Raw chunks of every dtype and shape, and objects, through the plan and the reader
    DCP loads with; on one rank (resharding is tests/integration/test_memory_tier.py)."""
    state = {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "h": torch.arange(6, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
        },
        "trainer": {"step": torch.tensor(7), "ledger": [[0, 16], [32, 48]], "lr": 0.25},
    }
    group = dist.new_group(backend="gloo")
    plan = _Plan.make(state, group, "node-0")
    path = tmp_path / "mem_00000007"
    path.mkdir()
    plan.prepare(state).write(str(path), 0)
    (path / ".metadata").write_bytes(plan.metadata_bytes)
    SnapshotInfo(7, 112, "job", ("job",), 1, 1).write(str(path))
    assert whole(str(path))[1] == ""
    assert (path / "__0.mem").stat().st_size == plan.tensor_bytes == 48 + 12 + 3 + 8
    assert plan.ranks == (0,) and plan.total_bytes == plan.tensor_bytes

    target = {
        "model": {
            "w": torch.zeros(3, 4),
            "h": torch.zeros(6, dtype=torch.bfloat16),
            "mask": torch.zeros(3, dtype=torch.bool),
        },
        "trainer": {"step": torch.tensor(0), "ledger": [], "lr": 0.0},
    }
    # The restore of this state reads both of the rank's files; one of a state with a
    # key the snapshot lacks cannot be planned at all.
    metadata = pickle.loads(plan.metadata_bytes)
    assert files_read(metadata, target) == {"__0.mem", "__0.obj"}
    assert whole(str(path), lambda m: files_read(m, target))[1] == ""
    extra = {**target, "model": {**target["model"], "bias": torch.zeros(2)}}
    assert whole(str(path), lambda m: files_read(m, extra))[1].startswith(
        f"{path}: does not hold this rank's state (Missing key in checkpoint state_dict: model.bias"
    )
    dcp.load(target, storage_reader=SnapshotReader(str(path)))
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["model"]["h"], state["model"]["h"])
    assert target["model"]["mask"].tolist() == [True, False, True]
    assert int(target["trainer"]["step"]) == 7
    assert target["trainer"]["ledger"] == [[0, 16], [32, 48]] and target["trainer"]["lr"] == 0.25

    # A state of another shape is not written under the old plan.
    state["model"]["w"] = torch.zeros(4, 4)
    assert plan.prepare(state) is None


def test_the_bound_stretches_the_interval_to_what_the_overhead_allows_and_holds_it_steady():
    # 15 ms snapshots against 60 ms steps: under 2 % needs one every 13 steps.
    assert bounded_interval(0.015, 0.060, 0.02, 1, 1) == 13
    assert bounded_interval(0.015, 0.060, 0.02, 20, 20) == 20  # never below --every
    # A little cheaper or dearer: the interval stays where it is...
    assert bounded_interval(0.013, 0.060, 0.02, 1, 13) == 13
    assert bounded_interval(0.011, 0.060, 0.02, 1, 13) == 13
    # ...until it is too short, or a quarter too long.
    assert bounded_interval(0.016, 0.060, 0.02, 1, 13) == 14
    assert bounded_interval(0.0055, 0.060, 0.02, 1, 13) == 5
    assert bounded_interval(0.0001, 0.060, 0.02, 1, 13) == 1
