"""Checkpoint verification: its pure parts (how the files are shared out between
ranks, how their findings combine) by table, and its rule on real directories,
in-process on a one-rank gloo group. Four ranks, and a directory missing on one node
only: tests/integration/test_verify_ranks.py."""

import os
import random
import shutil

import pytest

from tests.unit.trainer.runtimes import one_rank as runtime
from tests.unit.trainer.test_checkpoint_commit import model_state
from trainer import manifest, verify
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_dir import METADATA_FILE, committed_path
from trainer.ledger import Ledger
from trainer.verify import Finding, Verdict, VerdictKind

pytestmark = pytest.mark.timeout(120)

OK, UNVERIFIED, DAMAGED, UNREACHABLE = (
    VerdictKind.OK,
    VerdictKind.UNVERIFIED,
    VerdictKind.DAMAGED,
    VerdictKind.UNREACHABLE,
)


# --- pure: sharing out the files, combining the findings ------------------------------


@pytest.mark.parametrize(
    ("sizes", "ranks", "given"),
    [
        ([], 3, [[], [], []]),
        ([5], 3, [[0], [], []]),
        ([4, 4, 4, 4], 4, [[0], [1], [2], [3]]),
        # The largest first, each to the least loaded rank (the lowest on a tie).
        ([1, 8, 3, 5, 2], 2, [[1, 4], [0, 2, 3]]),
        ([10, 1, 1, 1, 1, 1, 1], 2, [[0], [1, 2, 3, 4, 5, 6]]),
        ([0, 0, 7], 2, [[2], [0, 1]]),
    ],
)
def test_shares_go_largest_first_to_the_least_loaded_rank(sizes, ranks, given):
    assert verify.shares(sizes, ranks) == given


def test_shares_cover_every_file_once_and_balance_bytes():
    rng = random.Random(5)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 100, rng.randrange(1 << 30)]) for _ in range(rng.randrange(40))]
        ranks = rng.randrange(1, 9)
        given = verify.shares(sizes, ranks)
        assert given == verify.shares(list(sizes), ranks)  # deterministic
        assert sorted(i for share in given for i in share) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in share) for share in given]
        # Greedy, largest first: no rank carries more than its part plus one file.
        assert max(loads) <= sum(sizes) / ranks + max(sizes, default=0)


PASSED = Verdict(OK, "its 3 files match", None)
BAD = Finding(DAMAGED, "__1_0.distcp does not match its checksum")
GONE = Finding(UNREACHABLE, "the directory is missing")


@pytest.mark.parametrize(
    ("found", "kind", "reason", "nodes"),
    [
        ([("a", None), ("b", None)], OK, "its 3 files match", ()),
        ([("a", None), ("b", BAD)], DAMAGED, f"{BAD.reason} (found by rank 1 on b)", ()),
        # Proven damage beats a node that could not read.
        ([("a", GONE), ("b", BAD)], DAMAGED, f"{BAD.reason} (found by rank 1 on b)", ()),
        ([("a", None), ("b", GONE)], UNREACHABLE, "the directory is missing on b (rank 1)", ("b",)),
        (
            [("a", None), ("b", GONE), ("b", GONE), ("c", GONE)],
            UNREACHABLE,
            "the directory is missing on b (rank 1; 3 ranks on 2 nodes could not)",
            ("b", "c"),
        ),
    ],
)
def test_findings_combine_damage_first_then_unreachable(found, kind, reason, nodes):
    assert verify.combine(PASSED, found) == Verdict(kind, reason, None, nodes)


# --- the rule, on real directories ----------------------------------------------------


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


CASES = {
    "whole": (OK, lambda d: None),
    "a flipped byte": (DAMAGED, lambda d: flip(d / "__0_0.distcp", 100)),
    "one byte short": (
        DAMAGED,
        lambda d: os.truncate(d / "__0_0.distcp", (d / "__0_0.distcp").stat().st_size - 1),
    ),
    "ledger gone": (DAMAGED, lambda d: (d / "ledger.json").unlink()),
    "a file where the directory was": (
        DAMAGED,
        lambda d: (shutil.rmtree(d), d.write_bytes(b"x")),
    ),
    "malformed manifest": (DAMAGED, lambda d: (d / manifest.MANIFEST_FILE).write_text("{")),
    "a manifest without .metadata": (
        DAMAGED,
        lambda d: (d / manifest.MANIFEST_FILE).write_text(
            '{"step": 1, "files": {"ledger.json": {"bytes": 1, "crc32": 0}}}'
        ),
    ),
    "no manifest": (UNVERIFIED, lambda d: (d / manifest.MANIFEST_FILE).unlink()),
    "no manifest, a shard cut short": (
        DAMAGED,
        lambda d: ((d / manifest.MANIFEST_FILE).unlink(), os.truncate(d / "__0_0.distcp", 10)),
    ),
    "no manifest, .metadata damaged": (
        DAMAGED,
        lambda d: ((d / manifest.MANIFEST_FILE).unlink(), (d / METADATA_FILE).write_bytes(b"\0")),
    ),
    "missing": (UNREACHABLE, lambda d: shutil.rmtree(d)),
    "a symlink loop": (UNREACHABLE, lambda d: (shutil.rmtree(d), d.symlink_to(d))),
    "a shard behind a symlink loop": (
        UNREACHABLE,
        lambda d: (
            (d / "__0_0.distcp").unlink(),
            (d / "__0_0.distcp").symlink_to(d / "__0_0.distcp"),
        ),
    ),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory, one_rank_group):
    directory = tmp_path_factory.mktemp("source")
    Checkpointer(
        str(directory), runtime(job_id="j-1"), use_async=False, keep=0, restored_from=None
    ).save(1, 16, model_state(1), Ledger([[1, 0, 16]]), 16)
    return committed_path(str(directory), 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_and_check_alone_agree_on_each_case(tmp_path, source, case):
    expected, change = CASES[case]
    directory = tmp_path / "step_00000001"
    shutil.copytree(source, directory)
    change(directory)
    alone = verify.check_alone(str(directory))
    split = verify.check(str(directory), node="n0")
    assert alone.kind == expected, alone
    assert split.kind == expected, split
    assert (alone.manifest is None) == (split.manifest is None)
    if expected is OK:
        assert alone.manifest.job_id == "j-1" and alone == split
    if expected is UNREACHABLE:
        assert alone.reason.endswith("on this node") and split.nodes == ("n0",), split
        assert split.reason.endswith("on n0 (rank 0)"), split
