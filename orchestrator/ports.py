"""Helpers for the local processes `keel up` starts: free ports, parent-death signals."""

import ctypes
import signal
import socket

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port that was free on ``host`` a moment ago.

    The socket is closed before returning, so the caller must bind promptly; every
    caller here binds within milliseconds and fails loudly if it lost the race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """``preexec_fn``: have the kernel SIGKILL this child when its parent dies.

    Runs Python between fork and exec, which is only safe in a parent that has no gRPC
    (or other) threads yet; the agent, which has them, uses ``agent.launch`` instead.
    """
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
