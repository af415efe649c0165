"""The manifest record (its stored form, schema 1 and 2, what a malformed one says),
reading and writing it, and the sums a commit writes into it: taken while DCP writes
the files, never read back; in-process on a one-rank gloo group."""

import json
import os
import zlib

import pytest

from tests.unit.trainer.runtimes import one_rank as runtime
from tests.unit.trainer.test_checkpoint_commit import model_state
from trainer import manifest
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_dir import committed_path
from trainer.ledger import Ledger
from trainer.manifest import FileSum, MalformedManifest, Manifest

pytestmark = pytest.mark.timeout(120)


# --- the manifest record -----------------------------------------------------------


def test_a_manifest_prints_and_parses_back_and_reads_schema_one():
    record = Manifest(
        step=7,
        files={"__0_0.distcp": FileSum(10, 123), ".metadata": FileSum(3, 1 << 31)},
        job_id="j-2",
        job="pretrain",
        lineage=("j-1", "j-2"),
        generation=4,
    )
    stored = json.loads(record.to_json())
    assert stored == {
        "schema": 2,
        "step": 7,
        "job_id": "j-2",
        "job": "pretrain",
        "lineage": ["j-1", "j-2"],
        "generation": 4,
        "files": {
            ".metadata": {"bytes": 3, "crc32": 1 << 31},
            "__0_0.distcp": {"bytes": 10, "crc32": 123},
        },
    }
    assert Manifest.parse(record.to_json()) == record
    # Written before manifests named their owner: the owner fields are empty.
    legacy = Manifest.parse('{"step": 5, "files": {"a": {"bytes": 1, "crc32": 2}}}')
    assert legacy == Manifest(step=5, files={"a": FileSum(1, 2)})
    assert legacy.schema == 1 and legacy.lineage == () and legacy.job_id == ""


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("", "does not parse"),
        ('{"step": 1, "fi', "does not parse"),
        (b"\xff\xfe", "does not parse"),
        ("[]", "does not parse: Expected `object`"),
        ('{"step": 1}', "does not parse: Object missing required field `files`"),
        ('{"step": "1", "files": {}}', "Expected `int`, got `str` - at `$.step`"),
        ('{"step": true, "files": {}}', "Expected `int`, got `bool`"),
        ('{"step": 1, "files": {"a": {"bytes": -1, "crc32": 0}}}', "Expected `int` >= 0"),
        ('{"step": 1, "files": {"a": {"bytes": 1, "crc32": 4294967296}}}', "<= 4294967295"),
        ('{"step": 1, "files": {"a": {"crc32": 0}}}', "missing required field `bytes`"),
        ('{"step": 1, "files": {"../x": {"bytes": 1, "crc32": 0}}}', "not a file inside"),
        ('{"step": 1, "files": {"/etc/x": {"bytes": 1, "crc32": 0}}}', "not a file inside"),
        ('{"step": 1, "files": {"a//b": {"bytes": 1, "crc32": 0}}}', "not a file inside"),
        ('{"step": 1, "files": {"manifest.json": {"bytes": 1, "crc32": 0}}}', "not a file"),
        ('{"schema": 3, "step": 1, "files": {}}', "is of schema 3; this version reads 1 and 2"),
        ('{"schema": 2, "step": 1, "lineage": "j", "files": {}}', "Expected `array`"),
    ],
)
def test_a_malformed_manifest_says_what_is_wrong(raw, problem):
    with pytest.raises(MalformedManifest, match="^manifest.json ") as raised:
        Manifest.parse(raw)
    assert problem in raised.value.problem


def test_read_tells_missing_unreadable_and_malformed_apart(tmp_path):
    with pytest.raises(FileNotFoundError):
        manifest.read(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        manifest.read(str(tmp_path / "gone"))
    path = tmp_path / manifest.MANIFEST_FILE
    os.symlink(path, path)  # ELOOP: an OSError that is not a missing file
    with pytest.raises(OSError) as raised:
        manifest.read(str(tmp_path))
    assert not isinstance(raised.value, FileNotFoundError)
    path.unlink()
    path.write_text('{"step": 1, "files": {')
    with pytest.raises(MalformedManifest):
        manifest.read(str(tmp_path))


def test_write_refuses_to_leave_a_file_without_a_sum(tmp_path):
    (tmp_path / "a").write_bytes(b"aaa")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"b")
    sums = manifest.checksum(str(tmp_path), ["a", "sub/b"])
    assert sums == {"a": FileSum(3, zlib.crc32(b"aaa")), "sub/b": FileSum(1, zlib.crc32(b"b"))}
    with pytest.raises(ValueError, match="would leave sub/b without a checksum"):
        manifest.write(str(tmp_path), Manifest(step=1, files={"a": sums["a"]}))
    assert not (tmp_path / manifest.MANIFEST_FILE).exists()
    manifest.write(str(tmp_path), Manifest(step=1, files=sums))
    assert manifest.read(str(tmp_path)) == Manifest(step=1, files=sums)


# --- the sums, taken while writing ----------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True])
def test_a_commit_writes_the_sums_taken_while_writing_and_its_owner(
    tmp_path, one_rank_group, monkeypatch, use_async
):
    read_back = []
    real_crc32 = manifest.crc32
    monkeypatch.setattr(manifest, "crc32", lambda path: read_back.append(path) or real_crc32(path))
    saver = Checkpointer(
        str(tmp_path),
        runtime(job_id="j-2", job="pretrain"),
        use_async=use_async,
        keep=0,
        restored_from=None,
    )
    saver.save(3, 48, model_state(3), Ledger([[1, 0, 16]]), 16)
    saver.wait()
    final = committed_path(str(tmp_path), 3)
    # Nothing DCP wrote was read back: only the ledger, rank 0's own small file.
    assert [os.path.basename(path) for path in read_back] == ["ledger.json"]
    written = manifest.read(final)
    names = sorted(set(os.listdir(final)) - {manifest.MANIFEST_FILE})
    assert names == [".metadata", "__0_0.distcp", "ledger.json"]
    assert dict(written.files) == manifest.checksum(final, names)
    assert (written.step, written.job_id, written.job, written.lineage, written.generation) == (
        3,
        "j-2",
        "pretrain",
        ("j-2",),
        2,
    )
    saver.settle(10)


def test_a_commit_names_the_lineage_it_is_given(tmp_path, one_rank_group):
    for directory, rt, lineage, written in (
        ("given", runtime(job_id="j-3"), ("j-1", "j-3"), ("j-1", "j-3")),
        ("outside keel", runtime(), (), ()),
    ):
        saver = Checkpointer(
            str(tmp_path / directory),
            rt,
            use_async=False,
            keep=0,
            restored_from=None,
            lineage=lineage,
        )
        saver.save(1, 16, model_state(1), Ledger(), 16)
        assert manifest.read(committed_path(saver.checkpoint_dir, 1)).lineage == written
