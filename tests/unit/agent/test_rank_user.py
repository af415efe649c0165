"""The rank user's permission arithmetic (``agent.rank_user``), on stat results built by
hand: which class of a file's mode applies, the first directory on a path that stops
a user, which of the agent's credentials a rank user could read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.rank_user import RankUser, exposed, unreachable
from common.permissions import READ, SEARCH, WRITE, allows, first_barrier

RANK = RankUser("keel-rank", uid=1500, gid=1500, home="/nonexistent")
ROOT, STAFF = 0, 50


def entry(mode: int, uid: int = ROOT, gid: int = ROOT, kind: int = stat.S_IFDIR):
    return os.stat_result((kind | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


def tree(entries: dict[str, os.stat_result]):
    def stat_of(path: Path) -> os.stat_result:
        try:
            return entries[str(path)]
        except KeyError:
            raise FileNotFoundError(path) from None

    return stat_of


@pytest.mark.parametrize(
    "mode, owner, group, want, allowed, why",
    [
        (0o600, 1500, ROOT, READ | WRITE, True, "its owner, rw"),
        (0o066, 1500, 1500, READ, False, "the owner class applies to the owner, not group"),
        (0o640, ROOT, 1500, READ, True, "its group, r"),
        (0o640, ROOT, 1500, WRITE, False, "its group, not w"),
        (0o604, ROOT, ROOT, READ, True, "anyone, r"),
        (0o600, ROOT, ROOT, READ, False, "root's alone"),
        (0o711, ROOT, ROOT, SEARCH, True, "anyone passes"),
        (0o711, ROOT, ROOT, READ, False, "nobody else lists"),
        (0o710, ROOT, 1500, SEARCH, True, "its group passes"),
        (0o710, ROOT, STAFF, SEARCH, False, "another group does not"),
    ],
)
def test_the_class_of_the_mode_that_applies_decides(mode, owner, group, want, allowed, why):
    assert allows(mode, owner, group, RANK.uid, RANK.groups(), want) is allowed, why


def test_the_first_directory_that_stops_the_user_is_named_with_its_mode_and_owner():
    stat_of = tree(
        {
            "/": entry(0o755),
            "/srv": entry(0o755),
            "/srv/keel": entry(0o700),
            "/srv/keel/tls": entry(0o755),
            "/srv/keel/tls/agent.key": entry(0o644, kind=stat.S_IFREG),
        }
    )
    why = first_barrier(Path("/srv/keel/tls/agent.key"), RANK.uid, RANK.groups(), READ, stat_of)
    assert why == "/srv/keel is mode 0700 owned by root:root"
    # The file itself stops it when every directory lets it pass.
    stat_of = tree({"/": entry(0o755), "/k": entry(0o711), "/k/t": entry(0o600, kind=0)})
    assert first_barrier(Path("/k/t"), RANK.uid, RANK.groups(), READ, stat_of) == (
        "/k/t is mode 0600 owned by root:root"
    )
    # A path that is not there is nobody's to read.
    assert first_barrier(Path("/k/none"), RANK.uid, RANK.groups(), READ, stat_of) is None


def test_a_credential_the_rank_user_can_read_is_named_with_the_fix():
    stat_of = tree(
        {
            "/": entry(0o755),
            "/etc": entry(0o755),
            "/etc/keel": entry(0o755),
            "/etc/keel/join.token": entry(0o644, kind=stat.S_IFREG),
            "/etc/keel/agent.key": entry(0o600, kind=stat.S_IFREG),
            "/etc/keel/group.key": entry(0o640, gid=1500, kind=stat.S_IFREG),
            "/etc/private": entry(0o700),
            "/etc/private/etcd.key": entry(0o644, kind=stat.S_IFREG),
        }
    )
    secrets = tuple(
        Path(p)
        for p in (
            "/etc/keel/join.token",
            "/etc/keel/agent.key",
            "/etc/keel/group.key",
            "/etc/private/etcd.key",
        )
    )
    lines = exposed(RANK, (*secrets, Path("/etc/keel/absent.token")), stat_of)
    assert lines == [
        f"the rank user keel-rank can read {path}; make it the agent's alone "
        f"(chmod 600 {path}, or chmod 700 its directory)"
        for path in ("/etc/keel/join.token", "/etc/keel/group.key")
    ]


def test_a_run_dir_under_a_closed_directory_is_refused_with_the_fix():
    stat_of = tree({"/": entry(0o755), "/root": entry(0o700), "/root/run": entry(0o755)})
    why = unreachable(RANK, Path("/root/run/agent"), stat_of)
    assert why == (
        "the rank user keel-rank cannot reach --run-dir /root/run/agent: /root is mode "
        "0700 owned by root:root; let it pass (chmod o+x that directory) or choose a "
        "run directory it can reach"
    )
    stat_of = tree({"/": entry(0o755), "/var": entry(0o755), "/var/keel": entry(0o711)})
    assert unreachable(RANK, Path("/var/keel/agent"), stat_of) is None


def test_a_rank_user_is_looked_up_by_name_and_root_or_a_stranger_is_refused():
    with pytest.raises(ValueError, match="ranks may not run as root"):
        RankUser.lookup("root")
    with pytest.raises(ValueError, match="no such user on this machine; create it"):
        RankUser.lookup("no-such-keel-user")
    nobody = RankUser.lookup("nobody")
    assert nobody.uid != 0 and nobody.name == "nobody"
    assert nobody.ids == (nobody.uid, nobody.gid)
    assert nobody.env() == {"HOME": nobody.home, "USER": "nobody", "LOGNAME": "nobody"}
