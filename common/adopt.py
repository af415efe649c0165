"""Making a running Python process into a rank it was not started as: the rank's whole
environment (as a fresh interpreter would see it) and its output files on fds 1 and 2.
Used by a warm process becoming its first rank (``agent.warm``) and by a rank that
restarts in place becoming the next generation's (``trainer.runtime``). Light: a warm
process runs it before its rank's imports are in question.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def coerced_locale(env: Mapping[str, str]) -> str | None:
    """The LC_CTYPE Python would set in ``env`` at start-up (PEP 538: a C or POSIX
    locale is coerced to a UTF-8 one unless LC_ALL is set or PYTHONCOERCECLOCALE=0),
    or None."""
    if "LC_ALL" in env or env.get("PYTHONCOERCECLOCALE") == "0":
        return None
    if (env.get("LC_CTYPE") or env.get("LANG") or "C") not in ("C", "POSIX"):
        return None
    import locale

    before = locale.setlocale(locale.LC_CTYPE)
    try:
        for target in ("C.UTF-8", "C.utf8", "UTF-8"):
            try:
                locale.setlocale(locale.LC_CTYPE, target)
                return target
            except locale.Error:
                continue
    finally:
        locale.setlocale(locale.LC_CTYPE, before)
    return None


def take_environment(env: Mapping[str, str]) -> None:
    """``os.environ`` becomes exactly ``env``, as a fresh interpreter started with it
    would have it (with PEP 538's locale coercion)."""
    os.environ.clear()
    os.environ.update(env)
    coerced = coerced_locale(env)
    if coerced:
        os.environ["LC_CTYPE"] = coerced


def redirect(fd: int, path: str, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT) -> None:
    """Point file descriptor ``fd`` at ``path``."""
    target = os.open(path, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def take_output(stdout: str, stderr: str) -> None:
    """fds 1 and 2 (and so ``sys.stdout``, ``sys.stderr``, faulthandler) write to these
    files from now on; what was buffered goes to the old ones first."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    redirect(1, stdout)
    redirect(2, stderr)
