"""Which checkpoint directory a submitted job may name, as a table."""

import pytest

from orchestrator.policy.admission import directory_taken
from protos import keel_pb2

JOBS = [("first", "id-1", "SUCCEEDED", "/ck/first"), ("nodir", "id-2", "RUNNING", "")]


@pytest.mark.parametrize(
    "checkpoint_dir, refused",
    [
        ("", ""),  # no directory: nothing to share
        ("/ck/second", ""),
        ("/ck/first", "checkpoint_dir /ck/first is job first's (id id-1, SUCCEEDED)"),
        ("/ck/./first/", "is job first's"),  # the same directory, spelled otherwise
        ("/ck/first/sub", ""),  # compared as text: a directory inside is not caught
    ],
)
def test_two_jobs_never_share_a_checkpoint_directory(checkpoint_dir, refused):
    why = directory_taken(keel_pb2.JobSpec(name="new", checkpoint_dir=checkpoint_dir), JOBS)
    if not refused:
        assert why == ""
        return
    assert refused in why and f'resume_from = "{checkpoint_dir}"' in why
