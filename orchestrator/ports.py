"""Free loopback ports, chosen by binding port 0 (never guessed)."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port that was free on ``host`` a moment ago.

    The socket is closed before returning, so the caller must bind promptly; every
    caller here binds within milliseconds and fails loudly if it lost the race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
