"""What `keel restore-epoch` says of a job's restore point, as this host sees the
checkpoint directory: an etcd snapshot older than the retention names checkpoints that
are gone."""

from pathlib import Path

from orchestrator.cli.restore_epoch import resumes_from
from orchestrator.policy.generation import RestorePoint


def test_a_restore_point_that_is_there_is_where_the_job_resumes(tmp_path: Path):
    (tmp_path / "step_00000008").mkdir()
    point = RestorePoint(str(tmp_path / "step_00000008"), 8, ())
    assert resumes_from(point) == f"resumes from {tmp_path}/step_00000008 (step 8)"
    assert resumes_from(RestorePoint()) == "has no checkpoint recorded: starts from step 0"


def test_a_deleted_restore_point_names_the_fallback_that_is_there_or_says_none_is(
    tmp_path: Path,
):
    (tmp_path / "step_00000004").mkdir()
    point = RestorePoint(
        str(tmp_path / "step_00000012"),
        12,
        (str(tmp_path / "step_00000008"), str(tmp_path / "step_00000004")),
    )
    said = resumes_from(point)
    assert f"its restore point {tmp_path}/step_00000012 (step 12) is not there" in said
    assert "keep etcd snapshots younger than --keep-checkpoints checkpoints" in said
    assert said.endswith(
        f"it falls back to {tmp_path}/step_00000004, the newest recorded one that is there"
    )
    (tmp_path / "step_00000004").rmdir()
    said = resumes_from(point)
    assert "nor is any older one recorded: its next generation cannot restore" in said
    assert "--resume-from a checkpoint that is there" in said
