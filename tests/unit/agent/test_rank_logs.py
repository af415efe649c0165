"""The agent's reads of a rank's output for the controller: bounded, from the offsets
asked, and a clear error for what is not there."""

from __future__ import annotations

from agent import rank_logs
from agent.supervisor import rank_log
from protos import keel_pb2


def _files(run_dir, out: bytes, err: bytes):
    path = rank_log(run_dir, "job-1", 2, 3, "out")
    path.parent.mkdir(parents=True)
    path.write_bytes(out)
    path.with_suffix(".err").write_bytes(err)
    return path


def test_it_reads_both_streams_from_their_offsets(tmp_path):
    path = _files(tmp_path, b"0123456789", b"abc")
    chunk = rank_logs.read(
        tmp_path,
        "node-a",
        keel_pb2.ReadLog(
            request_id=5, job="job-1", generation=2, rank=3, out_offset=4, err_offset=1, max_bytes=3
        ),
        running=True,
    )
    assert (chunk.request_id, chunk.out, chunk.out_offset, chunk.err, chunk.err_offset) == (
        5,
        b"456",
        7,
        b"bc",
        3,
    )
    assert chunk.running and chunk.path == str(path) and not chunk.error


def test_reads_are_bounded_and_an_offset_past_the_end_starts_again(tmp_path):
    _files(tmp_path, b"x" * (rank_logs.MAX_BYTES + 10), b"short")
    chunk = rank_logs.read(
        tmp_path,
        "n",
        keel_pb2.ReadLog(job="job-1", generation=2, rank=3, max_bytes=1 << 30, err_offset=99),
        running=False,
    )
    assert len(chunk.out) == rank_logs.MAX_BYTES
    assert chunk.err == b"short" and chunk.err_offset == 5
    default = rank_logs.read(
        tmp_path, "n", keel_pb2.ReadLog(job="job-1", generation=2, rank=3), running=False
    )
    assert len(default.out) == rank_logs.DEFAULT_BYTES


def test_a_missing_rank_or_a_bad_job_name_is_an_error_not_a_read(tmp_path):
    chunk = rank_logs.read(
        tmp_path, "node-a", keel_pb2.ReadLog(job="job-1", generation=1, rank=0), running=False
    )
    assert chunk.error.startswith("node node-a has no output of rank 0 of job job-1 generation 1")
    assert not chunk.out
    chunk = rank_logs.read(
        tmp_path, "node-a", keel_pb2.ReadLog(job="../../etc", generation=1), running=False
    )
    assert "is not one Keel gives a job" in chunk.error and not chunk.path
