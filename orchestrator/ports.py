"""Helpers for the local processes `keel up` starts: free ports, parent-death signals."""

import os
import socket
import sys


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port that was free on ``host`` a moment ago.

    The socket is closed before returning, so the caller must bind promptly; every
    caller here binds within milliseconds and fails loudly if it lost the race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tied_to_this_process() -> list[str]:
    """Argv prefix that runs a command so the kernel SIGKILLs it when this process dies.

    It is the agent's exec wrapper (``python -m agent.launch PID CMD...``), run as a
    program: it sets PR_SET_PDEATHSIG after the fork, in a fresh interpreter, which a
    ``preexec_fn`` cannot do safely once this process has gRPC threads.
    """
    return [sys.executable, "-m", "agent.launch", str(os.getpid())]
