"""How every Keel process secures its gRPC connections: mutual TLS and the token it
sends. (Its TLS and user/password towards etcd are ``common.etcd``'s credentials.)

A *TLS directory* (``--tls-dir``, as written by ``keel certs init``) holds ``ca.pem``
and, per party, ``<name>.pem``, ``<name>.key`` and ``<name>.token``. Precedence, for
every file: an explicit flag (``--ca``, ``--cert``, ``--key``, ``--token-file``, ...),
then the TLS directory, then (tokens only) the environment variable ``KEEL_TOKEN``.
With none of ``--tls-dir``/``--ca``/``--cert``/``--key`` the connection is plaintext.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from common import env


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one side of a mutual-TLS connection: the CA that signs every party
    it trusts, and its own certificate and private key."""

    ca: Path
    cert: Path
    key: Path

    def __post_init__(self):
        for flag, path in (("--ca", self.ca), ("--cert", self.cert), ("--key", self.key)):
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    def pems(self) -> tuple[bytes, bytes, bytes]:
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()


def first_identity(tls_dir: str | Path, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` whose certificate is in ``tls_dir``."""
    return next((n for n in names if (Path(tls_dir) / f"{n}.pem").is_file()), None)


def resolve_tls(
    tls_dir: str | Path | None,
    identity: str | None,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
) -> TlsFiles | None:
    """The files of party ``identity``: explicit paths first, then ``tls_dir``'s
    ``ca.pem``, ``<identity>.pem`` and ``<identity>.key``; None if nothing is given."""
    if tls_dir is None and not (ca or cert or key):
        return None
    base = Path(tls_dir) if tls_dir is not None else None
    paths = {
        "--ca": ca or (base and base / "ca.pem"),
        "--cert": cert or (base and identity and base / f"{identity}.pem"),
        "--key": key or (base and identity and base / f"{identity}.key"),
    }
    missing = [flag for flag, path in paths.items() if not path]
    if missing:
        raise ValueError(
            f"mutual TLS needs {', '.join(missing)} too (or --tls-dir "
            f"holding ca.pem, <name>.pem and <name>.key)"
        )
    return TlsFiles(*(Path(p) for p in paths.values()))


def read_token(token_file: str | Path | None, fallback: Path | None = None) -> str:
    """``token_file``'s token, else ``fallback``'s (a TLS directory's) if it exists,
    else ``KEEL_TOKEN``; "" if none."""
    for path in (token_file, fallback):
        if path and Path(path).is_file():
            return Path(path).read_text().strip()
    return os.environ.get(env.TOKEN, "")


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates a client call."""
    return (("authorization", f"Bearer {token}"),)


# ----------------------------------------------------------------------- gRPC
def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that demand a client certificate signed by ``files.ca``."""
    ca, cert, key = files.pems()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )
