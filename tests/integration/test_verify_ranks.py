"""Checkpoint verification split between ranks agrees with one process reading
everything, on four real ranks (gloo) over real files: whole, damaged, unmanifested
and unreachable checkpoints, a table of them and seeded random changes, and a
checkpoint directory missing on one node only (a mount namespace of that rank's own).
And the saves that made them: every rank summed its shard file as it wrote it, and the
manifest holds those sums and the writing job's lineage, with nothing read back.

One launch (``scripts/verify_cases.py``) saves, makes the cases and checks them."""

import json

import pytest

from tests.conftest import REPO, torchrun

SCRIPT = REPO / "tests" / "integration" / "scripts" / "verify_cases.py"
FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "ledger.json"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_check_on_four_ranks_agrees_with_check_alone(tmp_path):
    run = torchrun(4, str(SCRIPT), str(tmp_path), "25")
    assert run.returncode == 0, f"launch failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    lines = run.stdout.splitlines()
    saved = {
        s["name"]: s
        for s in (
            json.loads(line.removeprefix("SAVED ")) for line in lines if line.startswith("SAVED ")
        )
    }
    results = [
        json.loads(line.removeprefix("RESULT ")) for line in lines if line.startswith("RESULT ")
    ]

    # Each rank's shard file and rank 0's .metadata summed while written, ledger.json
    # read: the manifest lists every file, and each sum is the file's.
    for name, lineage in (("sync", ["job-b"]), ("async", ["job-a", "job-b"])):
        assert saved[name]["files"] == saved[name]["on_disk"] == FILES, saved[name]
        assert saved[name]["sums_match"], saved[name]
        assert (saved[name]["job_id"], saved[name]["job"], saved[name]["generation"]) == (
            "job-b",
            "verify-job",
            3,
        )
        assert saved[name]["lineage"] == lineage

    assert len(results) == 14 + 12 + 2
    for result in results:
        kinds = set(result["check"])
        assert len(kinds) == 1, f"the ranks disagree: {result}"
        (kind,) = kinds
        if result["expected"] is not None:
            assert kind == result["expected"], result
        if result["name"] == "missing on rank 3's node":
            # Rank 0 alone reads it whole; rank 3's node cannot, and is named.
            assert result["alone"] == "OK", result
            assert result["nodes"] == [["node1"]] * 4, result
            assert "the directory is missing on node1 (rank 3)" in result["reasons"][0]
            continue
        assert kind == result["alone"], f"check and check_alone disagree: {result}"
        if kind == "UNREACHABLE":
            assert result["nodes"] == [["node0"]] * 4, result
    random_kinds = {r["check"][0] for r in results if r["expected"] is None}
    assert {"DAMAGED", "UNVERIFIED"} <= random_kinds, "the random cases hardly vary"
