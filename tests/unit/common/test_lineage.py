"""Which lineage a checkpoint directory belongs to, and whether a job may write there:
real directories and fence files."""

from __future__ import annotations

import pytest

from common.lineage import FENCE_FILE, Owner, checkpoints_in, read_owner, refusal


def make(tmp_path, fence: str | None, entries=()):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    if fence is not None:
        (directory / FENCE_FILE).write_text(fence)
    for name in entries:
        (directory / name).mkdir()
    return str(directory)


MINE = Owner(4, "id-mine", "train", ("id-origin", "id-mine")).to_json()
THEIRS = Owner(9, "id-theirs", "other", ("id-theirs",)).to_json()
LEGACY = '{"generation": 7}'


@pytest.mark.parametrize(
    "fence, entries, job_id, restore_from, refused",
    [
        # Nothing of anyone's is there: any job may take the directory.
        (None, (), "id-mine", "", ""),
        (THEIRS, (".step_00000005.g9.tmp",), "id-mine", "", ""),
        # Its own checkpoints.
        (MINE, ("step_00000010",), "id-mine", "", ""),
        # Another job's checkpoints, kept or set aside: refused, naming the owner.
        (THEIRS, ("step_00000010",), "id-mine", "", "job other (id id-theirs"),
        (THEIRS, (".quarantine.step_00000010.g3",), "id-mine", "", "job other"),
        # A job not yet submitted owns nothing.
        (MINE, ("step_00000010",), "", "", "job train (id id-mine, lineage id-origi→id-mine)"),
        # From before fences named their job: the job whose records point there keeps it.
        (LEGACY, ("step_00000010",), "id-mine", "CKPT/step_00000010", ""),
        (LEGACY, ("step_00000010",), "id-mine", "", "an unknown lineage (no fence names"),
        (None, ("step_00000010",), "id-mine", "", "an unknown lineage"),
        ("not json", ("step_00000010",), "id-mine", "", "is unreadable"),
    ],
)
def test_a_job_writes_only_where_no_other_lineage_has_checkpoints(
    tmp_path, fence, entries, job_id, restore_from, refused
):
    directory = make(tmp_path, fence, entries)
    why = refusal(directory, job_id, restore_from.replace("CKPT", directory))
    if not refused:
        assert why == ""
        return
    assert refused in why
    # The two ways on, always.
    assert "a new checkpoint directory" in why and f"--resume-from {directory}" in why


def test_the_fence_round_trips_and_reads_the_old_form(tmp_path):
    directory = make(tmp_path, MINE, ("step_00000010", "step_00000020", "other"))
    assert read_owner(directory) == Owner(4, "id-mine", "train", ("id-origin", "id-mine"))
    assert checkpoints_in(directory) == ["step_00000010", "step_00000020"]
    (tmp_path / "ckpt" / FENCE_FILE).write_text(LEGACY)
    assert read_owner(directory) == Owner(7)
    assert read_owner(str(tmp_path / "missing")) is None
    assert checkpoints_in(str(tmp_path / "missing")) == []
