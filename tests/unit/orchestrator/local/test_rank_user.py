"""``keel up``'s rank user (``orchestrator.local.rank_user``): the one line it says when
its ranks run as its own user, and the refusal when it is not root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.local.rank_user import notice, prepare


def test_the_notice_says_what_the_ranks_can_read_and_how_to_change_it():
    workdir = Path("/srv/run")
    assert notice(0, "root", workdir) == (
        "ranks run as root, as the agents do, and can read the cluster's keys and "
        "tokens in /srv/run; give --rank-user USER to run them as another user "
        "(created if missing)"
    )
    assert notice(1000, "ada", workdir) == (
        "ranks run as ada, as the agents do, and can read the cluster's keys and "
        "tokens in /srv/run; only root can run them as another user (keel up "
        "--rank-user USER, as root)"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may start ranks as another user")
def test_a_rank_user_without_root_is_refused_before_anything_changes(tmp_path):
    with pytest.raises(ValueError, match="only root starts ranks as another user"):
        prepare("keel-rank", tmp_path, tmp_path / "checkpoints", None)
    assert not (tmp_path / "checkpoints").exists()
