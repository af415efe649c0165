"""How the controller and the operator CLI secure their connections: mutual TLS on
the controller's gRPC port, the role tokens, and TLS and user/password towards etcd.

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

import click
import grpc

from orchestrator.etcd_client import EtcdCredentials
from orchestrator.auth import Role, Tokens


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


def resolve_tls(tls_dir: str | Path | None, identity: str | None, ca: str | None = None,
                cert: str | None = None, key: str | None = None) -> TlsFiles | None:
    """The files of party ``identity``: explicit paths first, then ``tls_dir``'s
    ``ca.pem``, ``<identity>.pem`` and ``<identity>.key``; None if nothing is given."""
    if tls_dir is None and not (ca or cert or key):
        return None
    base = Path(tls_dir) if tls_dir is not None else None
    paths = {"--ca": ca or (base and base / "ca.pem"),
             "--cert": cert or (base and identity and base / f"{identity}.pem"),
             "--key": key or (base and identity and base / f"{identity}.key")}
    missing = [flag for flag, path in paths.items() if not path]
    if missing:
        raise ValueError(f"mutual TLS needs {', '.join(missing)} too (or --tls-dir "
                         f"holding ca.pem, <name>.pem and <name>.key)")
    return TlsFiles(*(Path(p) for p in paths.values()))


def read_token(token_file: str | Path | None, fallback: Path | None = None) -> str:
    """``token_file``'s token, else ``fallback``'s (a TLS directory's) if it exists,
    else ``KEEL_TOKEN``; "" if none."""
    for path in (token_file, fallback):
        if path and Path(path).is_file():
            return Path(path).read_text().strip()
    return os.environ.get("KEEL_TOKEN", "")


# ----------------------------------------------------------------------- gRPC
def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that demand a client certificate signed by ``files.ca``."""
    ca, cert, key = files.pems()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


def add_port(server: grpc.Server, listen: str, files: TlsFiles | None) -> int:
    """Bind ``listen`` with mutual TLS (plaintext if ``files`` is None); the port."""
    if files is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, server_credentials(files))


def channel(address: str, files: TlsFiles | None) -> grpc.Channel:
    """A channel to ``address`` presenting ``files.cert`` and trusting only
    ``files.ca`` (plaintext if ``files`` is None)."""
    if files is None:
        return grpc.insecure_channel(address)
    ca, cert, key = files.pems()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert))


# ----------------------------------------------------------------------- etcd
def etcd_credentials(etcd_ca=None, etcd_cert=None, etcd_key=None, etcd_user=None,
                     etcd_password=None, **_) -> EtcdCredentials | None:
    """The etcd credentials of the ``etcd_options`` flags; None if none is given."""
    if not (etcd_ca or etcd_cert or etcd_key or etcd_user or etcd_password):
        return None
    return EtcdCredentials(ca=Path(etcd_ca) if etcd_ca else None,
                           cert=Path(etcd_cert) if etcd_cert else None,
                           key=Path(etcd_key) if etcd_key else None,
                           user=etcd_user or None, password=etcd_password or None)


def etcd_flags(credentials: EtcdCredentials | None) -> list[str]:
    """The flags that hand ``credentials`` to a child daemon, bar the password (the
    child reads that from KEEL_ETCD_PASSWORD)."""
    if credentials is None:
        return []
    flags = {"--etcd-ca": credentials.ca, "--etcd-cert": credentials.cert,
             "--etcd-key": credentials.key, "--etcd-user": credentials.user}
    return [part for flag, value in flags.items() if value for part in (flag, str(value))]


# ------------------------------------------------------------------- options
_FILE = click.Path(exists=True, dir_okay=False)


def etcd_options(command):
    """``--etcd-ca``, ``--etcd-cert``, ``--etcd-key``, ``--etcd-user``,
    ``--etcd-password``."""
    for option in reversed([
        click.option("--etcd-ca", type=_FILE, default=None,
                     help="CA certificate of etcd's server certificate: talk to etcd over "
                          "TLS."),
        click.option("--etcd-cert", type=_FILE, default=None,
                     help="Client certificate for etcd (with --etcd-key and --etcd-ca)."),
        click.option("--etcd-key", type=_FILE, default=None,
                     help="Private key of --etcd-cert."),
        click.option("--etcd-user", default=None,
                     help="etcd user, when etcd has authentication enabled."),
        click.option("--etcd-password", envvar="KEEL_ETCD_PASSWORD", default=None,
                     help="Password of --etcd-user (env KEEL_ETCD_PASSWORD; prefer it: "
                          "flags show in ps)."),
    ]):
        command = option(command)
    return command


def tls_options(party: str, uses: str):
    """``--tls-dir``, ``--ca``, ``--cert``, ``--key`` for ``party``'s certificate;
    ``uses`` says which files of the TLS directory it takes."""
    def decorate(command):
        for option in reversed([
            click.option("--tls-dir", type=click.Path(exists=True, file_okay=False),
                         default=None,
                         help=f"Directory from `keel certs init`: use its {uses}; turns on "
                              f"mutual TLS."),
            click.option("--ca", type=_FILE, default=None,
                         help="CA certificate that signs every party (overrides --tls-dir)."),
            click.option("--cert", type=_FILE, default=None,
                         help=f"The {party} certificate (overrides --tls-dir)."),
            click.option("--key", type=_FILE, default=None,
                         help=f"The {party} private key (overrides --tls-dir)."),
        ]):
            command = option(command)
        return command
    return decorate


def role_token_options(command):
    """The controller's ``--join-token-file``, ``--operator-token-file``,
    ``--reader-token-file``."""
    for role, who in reversed((("join", "agents (may only Connect)"),
                               ("operator", "operators (every call, mutating ones included)"),
                               ("reader", "read-only calls (GetJob, ListJobs, ListNodes)"))):
        command = click.option(
            f"--{role}-token-file", type=_FILE, default=None,
            help=f"Token of {who}; default: --tls-dir's {role}.token.")(command)
    return command


def controller_settings(token_file: str | None, security: dict) -> dict:
    """``ControllerConfig`` fields (token, tokens, tls, etcd_credentials) from the
    controller's flags.

    Tokens: ``--token-file`` is one token for every role (as before roles existed);
    else the three role token files (flags, then ``--tls-dir``) if any is there; else
    ``KEEL_TOKEN`` for every role."""
    tls_dir = security.get("tls_dir")
    flags = {role: security.get(f"{role.value}_token_file") for role in Role}
    if token_file and any(flags.values()):
        raise ValueError("give either --token-file (one token for every role) or "
                         "--join/--operator/--reader-token-file, not both")
    role_files = {role: flag or (Path(tls_dir) / f"{role.value}.token" if tls_dir else None)
                  for role, flag in flags.items()}
    role_files = {role: path for role, path in role_files.items()
                  if path and Path(path).is_file()}
    tokens = None
    token = ""
    if token_file or not role_files:
        token = read_token(token_file)
    else:
        missing = [f"{r.value}.token" for r in Role if r not in role_files]
        if missing:
            raise ValueError(f"role tokens: {', '.join(missing)} missing; give all three "
                             f"(--join/--operator/--reader-token-file or --tls-dir)")
        tokens = Tokens(**{r.value: Path(p).read_text().strip()
                           for r, p in role_files.items()})
    return {"token": token, "tokens": tokens,
            "tls": resolve_tls(tls_dir, "controller", security.get("ca"),
                               security.get("cert"), security.get("key")),
            "etcd_credentials": etcd_credentials(**security)}


CLIENT_IDENTITIES = ("operator", "reader")


def client_settings(token_file: str | None, security: dict
                    ) -> tuple[str, TlsFiles | None, EtcdCredentials | None]:
    """An operator client's token, TLS files and etcd credentials. From ``--tls-dir``
    it takes the operator identity if the directory holds one, else the reader's."""
    tls_dir = security.get("tls_dir")
    identity = first_identity(tls_dir, CLIENT_IDENTITIES) if tls_dir else None
    if tls_dir and identity is None and not security.get("cert"):
        raise ValueError(f"--tls-dir {tls_dir} holds neither operator.pem nor reader.pem; "
                         f"give --cert and --key")
    files = resolve_tls(tls_dir, identity, security.get("ca"), security.get("cert"),
                        security.get("key"))
    token = read_token(token_file, Path(tls_dir) / f"{identity}.token" if identity else None)
    return token, files, etcd_credentials(**security)
