"""Whose ranks a local cluster runs (``keel up --rank-user USER``): its agents are
started with ``--rank-user`` (``agent.rank_user``), and the work directory is set up
for that user: passable, its checkpoints the rank user's, its TLS directory, token
and logs keel up's alone. Without a rank user, ``notice`` is the one line that says
what the ranks can then read.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

from common.permissions import READ, SEARCH, first_barrier


def notice(euid: int, user: str, workdir: Path) -> str:
    """The line ``keel up`` says once at start when its ranks run as its own user
    (``user``, uid ``euid``). Pure."""
    exposed = f"the cluster's keys and tokens in {workdir}"
    if euid == 0:
        return (
            f"ranks run as root, as the agents do, and can read {exposed}; give "
            f"--rank-user USER to run them as another user (created if missing)"
        )
    return (
        f"ranks run as {user}, as the agents do, and can read {exposed}; only root "
        f"can run them as another user (keel up --rank-user USER, as root)"
    )


def prepare(name: str, workdir: Path, checkpoints: Path, script: str | None) -> pwd.struct_passwd:
    """Make ``name`` a user (a system user without home or shell, if it is missing)
    and ``workdir`` ready for ranks run as it; raises ValueError saying what to fix if
    this is not root, or if the user could not reach what its ranks need."""
    if os.geteuid() != 0:
        raise ValueError(
            f"--rank-user {name}: only root starts ranks as another user; run keel up "
            f"as root, or without --rank-user"
        )
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        try:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise OSError(f"--rank-user {name}: cannot create the user: {detail.strip()}") from None
        user = pwd.getpwnam(name)
    if user.pw_uid == 0:
        raise ValueError(f"--rank-user {name}: ranks may not run as root")
    # Passable to the nodes' run directories and the checkpoints, listable by none.
    os.chmod(workdir, 0o711)
    for own in ("logs", "prometheus"):
        (workdir / own).mkdir(exist_ok=True)
        os.chmod(workdir / own, 0o700)
    checkpoints.mkdir(parents=True, exist_ok=True)
    os.chown(checkpoints, user.pw_uid, user.pw_gid)
    gids = frozenset({user.pw_gid})
    needs = [
        (workdir, SEARCH, "the work directory"),
        (Path(os.path.realpath(sys.executable)), READ | SEARCH, "this Python"),
    ]
    if script:
        needs.append((Path(script).resolve(), READ, "--script"))
    for path, want, what in needs:
        barrier = first_barrier(path, user.pw_uid, gids, want)
        if barrier:
            raise ValueError(
                f"--rank-user {name} cannot reach {what} ({path}): {barrier}; let it "
                f"(chmod o+x the directory, o+r the file) or put it where it can"
            )
    return user
