"""The controller's and the operator CLI's security settings from their flags: which
certificate each presents, which token (or three role tokens) it holds, and the etcd
credentials. The TLS core (files, channels, ports) is ``common.tls``."""

from __future__ import annotations

from pathlib import Path

import click

from common.etcd import EtcdCredentials, etcd_credentials
from common.flags import FILE
from common.tls import TlsFiles, first_identity, read_token, resolve_tls
from orchestrator.security.auth import Role, Tokens


def role_token_options(command):
    """The controller's ``--join-token-file``, ``--operator-token-file``,
    ``--reader-token-file``."""
    for role, who in reversed(
        (
            ("join", "agents (may only Connect)"),
            ("operator", "operators (every call, mutating ones included)"),
            ("reader", "read-only calls (status, listings, logs)"),
        )
    ):
        command = click.option(
            f"--{role}-token-file",
            type=FILE,
            default=None,
            help=f"Token of {who}; default: --tls-dir's {role}.token.",
        )(command)
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
        raise ValueError(
            "give either --token-file (one token for every role) or "
            "--join/--operator/--reader-token-file, not both"
        )
    role_files = {
        role: flag or (Path(tls_dir) / f"{role.value}.token" if tls_dir else None)
        for role, flag in flags.items()
    }
    role_files = {role: path for role, path in role_files.items() if path and Path(path).is_file()}
    tokens = None
    token = ""
    if token_file or not role_files:
        token = read_token(token_file)
    else:
        missing = [f"{r.value}.token" for r in Role if r not in role_files]
        if missing:
            raise ValueError(
                f"role tokens: {', '.join(missing)} missing; give all three "
                f"(--join/--operator/--reader-token-file or --tls-dir)"
            )
        tokens = Tokens(**{r.value: Path(p).read_text().strip() for r, p in role_files.items()})
    return {
        "token": token,
        "tokens": tokens,
        "tls": resolve_tls(
            tls_dir, "controller", security.get("ca"), security.get("cert"), security.get("key")
        ),
        "etcd_credentials": etcd_credentials(**security),
    }


CLIENT_IDENTITIES = ("operator", "reader")


def client_settings(
    token_file: str | None, security: dict
) -> tuple[str, TlsFiles | None, EtcdCredentials | None]:
    """An operator client's token, TLS files and etcd credentials. From ``--tls-dir``
    it takes the operator identity if the directory holds one, else the reader's."""
    tls_dir = security.get("tls_dir")
    identity = first_identity(tls_dir, CLIENT_IDENTITIES) if tls_dir else None
    if tls_dir and identity is None and not security.get("cert"):
        raise ValueError(
            f"--tls-dir {tls_dir} holds neither operator.pem nor reader.pem; give --cert and --key"
        )
    files = resolve_tls(
        tls_dir, identity, security.get("ca"), security.get("cert"), security.get("key")
    )
    token = read_token(token_file, Path(tls_dir) / f"{identity}.token" if identity else None)
    return token, files, etcd_credentials(**security)


def bootstrap_options(command):
    """The controller's TLS-bootstrapping flags (``orchestrator.controller.bootstrap``)."""
    options = (
        click.option(
            "--bootstrap-port",
            type=click.IntRange(0, 65535),
            default=None,
            help="Serve TLS bootstrapping here (on the --listen host; 0: a free port): "
            "an agent holding only ca.pem and the join token asks for its node's own "
            "certificate, signed by the CA key (needs --tls-dir). Default: not served.",
        ),
        click.option(
            "--ca-key",
            type=FILE,
            default=None,
            help="The CA's private key that signs nodes' certificates; default: "
            "--tls-dir's ca.key.",
        ),
        click.option(
            "--approve-agents",
            is_flag=True,
            help="A node's first certificate request waits for `keel certs approve "
            "NODE` (default: the first request for a node is signed at once).",
        ),
        click.option(
            "--agent-certificate-lifetime-s",
            type=float,
            default=30 * 24 * 3600.0,
            show_default=True,
            help="How long a node's signed certificate lasts; its agent renews it at 2/3 of that.",
        ),
        click.option(
            "--allow-shared-agent-certificate",
            is_flag=True,
            help="Accept a Hello over the one agent certificate every node shares "
            "(agent.pem), which binds no node: any holder may speak for any node. "
            "Default: refused; give each node its own (--bootstrap-port, or "
            "`keel certs init --agent NODE`).",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


def bootstrap_settings(
    tls_dir: str | None,
    bootstrap_port: int | None,
    ca_key: str | None,
    approve_agents: bool,
    agent_certificate_lifetime_s: float,
    allow_shared_agent_certificate: bool,
) -> dict:
    """``ControllerConfig``'s TLS-bootstrapping fields from the flags of
    ``bootstrap_options``."""
    key = ca_key or (Path(tls_dir) / "ca.key" if tls_dir and bootstrap_port is not None else None)
    if key is not None and not Path(key).is_file():
        raise ValueError(f"--ca-key {key}: no such file (the CA key signs nodes' certificates)")
    return {
        "bootstrap_port": bootstrap_port,
        "ca_key": Path(key) if key else None,
        "approve_agents": approve_agents,
        "agent_certificate_lifetime_s": agent_certificate_lifetime_s,
        "allow_shared_agent_certificate": allow_shared_agent_certificate,
    }
