"""``python -m common.launch PARENT_PID CMD...``: exec CMD so that it dies with its parent.

PR_SET_PDEATHSIG survives execve, so a rank is SIGKILLed if its agent dies (and a daemon
if `keel up` dies), even by SIGKILL. It is set here rather than in a ``preexec_fn``
because the parents run gRPC threads, and running Python between fork and exec in such
a process can deadlock or abort on a lock a gRPC thread held at the fork.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m common.launch PARENT_PID CMD [ARGS...]")
    parent = int(sys.argv[1])
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect; then nobody would kill us.
    if os.getppid() != parent:
        sys.exit(f"parent {parent} exited before {sys.argv[2]!r} started")
    command = sys.argv[2:]
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.exit(f"cannot execute {command[0]!r}: {exc}")


if __name__ == "__main__":
    main()
