"""``python -m common.launch PARENT_PID [--as UID:GID] CMD...``: exec CMD so that it dies
with its parent (and, with ``--as``, as user UID of group GID, with no supplementary
groups).

PR_SET_PDEATHSIG survives execve, so a rank is SIGKILLed if its agent dies (and a daemon
if `keel up` dies), even by SIGKILL. It is set here rather than in a ``preexec_fn``
because the parents run gRPC threads, and running Python between fork and exec in such
a process can deadlock or abort on a lock a gRPC thread held at the fork. The user is
changed here for the same reason: ``subprocess.Popen(user=...)`` cannot use vfork, and
a plain fork of such a parent runs gRPC's fork handlers in the child, which abort
(abseil's "Mutex::Fer with pending CondVar"). It is changed before the parent-death
signal is set, since a change of credentials clears that signal.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m common.launch PARENT_PID [--as UID:GID] CMD [ARGS...]")
    parent, command = int(sys.argv[1]), sys.argv[2:]
    if command[:1] == ["--as"]:
        uid, gid = (int(n) for n in command[1].split(":"))
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        except OSError as exc:
            sys.exit(f"cannot become uid {uid} gid {gid}: {exc}")
        command = command[2:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect; then nobody would kill us.
    if os.getppid() != parent:
        sys.exit(f"parent {parent} exited before {command[0]!r} started")
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.exit(f"cannot execute {command[0]!r}: {exc}")


if __name__ == "__main__":
    main()
