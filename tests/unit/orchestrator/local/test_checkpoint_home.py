"""Where a local run writes its checkpoints when its directory holds another
lineage's: refused with the two ways on, or, resuming from them, beside them."""

import pytest

from common.lineage import FENCE_FILE, Owner
from orchestrator.local.lineage import checkpoint_home


def test_a_directory_of_another_lineage_is_refused_or_left_for_a_new_one(tmp_path):
    default = tmp_path / "checkpoints"
    assert checkpoint_home(default, "", chosen=False) == (default, ""), "nothing there yet"
    (default / "step_00000040").mkdir(parents=True)
    (default / FENCE_FILE).write_text(Owner(1, "first", "keel-up", ("first",)).to_json())
    with pytest.raises(ValueError, match=r"holds checkpoints of job keel-up \(id first"):
        checkpoint_home(default, "", chosen=False)
    # Named by the user: used or refused, never replaced by another.
    with pytest.raises(ValueError, match="--resume-from"):
        checkpoint_home(default, str(default), chosen=True)
    home, why = checkpoint_home(default, str(default), chosen=False)
    assert home == tmp_path / "checkpoints-2"
    assert f"writes its own in {home}" in why and "read, never changed" in why
    # That one taken by a lineage too: the next.
    (home / "step_00000050").mkdir(parents=True)
    assert checkpoint_home(default, str(default), chosen=False)[0] == tmp_path / "checkpoints-3"
