"""How the agent secures its connections: a client certificate towards the controller
(mutual TLS), its join token, and TLS and user/password towards etcd.

From a TLS directory (``--tls-dir``, as written by ``keel certs init``) the agent takes
``ca.pem``, its certificate ``agent-<node>.pem``/``.key`` if there is one, else the
shared ``agent.pem``/``.key``, and ``join.token``. Explicit flags (``--ca``,
``--cert``, ``--key``, ``--token-file``) win over the directory; ``KEEL_TOKEN`` is
the last resort for the token. Without any of them the channel is plaintext.

(The controller's side lives in ``orchestrator.tls``; the agent never imports it.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import click
import grpc

from agent.etcd_client import EtcdCredentials

@dataclass(frozen=True)
class TlsFiles:
    """The CA that signs the controller's certificate, and this agent's certificate
    and private key."""
    ca: Path
    cert: Path
    key: Path

    def __post_init__(self):
        for flag, path in (("--ca", self.ca), ("--cert", self.cert), ("--key", self.key)):
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")


def channel(address: str, files: TlsFiles | None) -> grpc.Channel:
    """A channel to the controller presenting this agent's certificate and trusting
    only ``files.ca`` (plaintext if ``files`` is None)."""
    if files is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=files.ca.read_bytes(), private_key=files.key.read_bytes(),
        certificate_chain=files.cert.read_bytes()))


def settings(node: str, token_file: str | None, tls_dir: str | None = None,
             ca: str | None = None, cert: str | None = None, key: str | None = None,
             etcd_ca: str | None = None, etcd_cert: str | None = None,
             etcd_key: str | None = None, etcd_user: str | None = None,
             etcd_password: str | None = None) -> dict:
    """``AgentConfig`` fields (token, tls, etcd_credentials) from the agent's flags."""
    base = Path(tls_dir) if tls_dir else None
    identity = None
    if base is not None:
        identity = next((n for n in (f"agent-{node}", "agent")
                         if (base / f"{n}.pem").is_file()), None)
        if identity is None and not cert:
            raise ValueError(f"--tls-dir {tls_dir} holds neither agent-{node}.pem nor "
                             f"agent.pem; give --cert and --key")
    files = None
    if base is not None or ca or cert or key:
        paths = {"--ca": ca or (base and base / "ca.pem"),
                 "--cert": cert or (base and identity and base / f"{identity}.pem"),
                 "--key": key or (base and identity and base / f"{identity}.key")}
        missing = [flag for flag, path in paths.items() if not path]
        if missing:
            raise ValueError(f"mutual TLS needs {', '.join(missing)} too (or --tls-dir)")
        files = TlsFiles(*(Path(p) for p in paths.values()))
    token = os.environ.get("KEEL_TOKEN", "")
    for path in (token_file, base and base / "join.token"):
        if path and Path(path).is_file():
            token = Path(path).read_text().strip()
            break
    etcd = None
    if etcd_ca or etcd_cert or etcd_key or etcd_user or etcd_password:
        etcd = EtcdCredentials(ca=Path(etcd_ca) if etcd_ca else None,
                               cert=Path(etcd_cert) if etcd_cert else None,
                               key=Path(etcd_key) if etcd_key else None,
                               user=etcd_user or None, password=etcd_password or None)
    return {"token": token, "tls": files, "etcd_credentials": etcd}


_FILE = click.Path(exists=True, dir_okay=False)

OPTIONS = [
    click.option("--tls-dir", type=click.Path(exists=True, file_okay=False), default=None,
                 help="Directory from `keel certs init`: use its ca.pem, agent-NODE.pem "
                      "(else agent.pem) and key, and join.token; turns on mutual TLS."),
    click.option("--ca", type=_FILE, default=None,
                 help="CA certificate of the controller (overrides --tls-dir)."),
    click.option("--cert", type=_FILE, default=None,
                 help="This agent's client certificate (overrides --tls-dir)."),
    click.option("--key", type=_FILE, default=None,
                 help="This agent's private key (overrides --tls-dir)."),
    click.option("--etcd-ca", type=_FILE, default=None,
                 help="CA certificate of etcd's server certificate: talk to etcd over TLS."),
    click.option("--etcd-cert", type=_FILE, default=None,
                 help="Client certificate for etcd (with --etcd-key and --etcd-ca)."),
    click.option("--etcd-key", type=_FILE, default=None, help="Private key of --etcd-cert."),
    click.option("--etcd-user", default=None,
                 help="etcd user, when etcd has authentication enabled."),
    click.option("--etcd-password", envvar="KEEL_ETCD_PASSWORD", default=None,
                 help="Password of --etcd-user (env KEEL_ETCD_PASSWORD; prefer it: flags "
                      "show in ps)."),
]


def options(command):
    """The agent's TLS and etcd credential flags."""
    for option in reversed(OPTIONS):
        command = option(command)
    return command
