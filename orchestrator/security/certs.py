"""``keel certs init``: a private CA, and the certificates, keys and tokens of a cluster;
``keel certs add``: certificates of more agent nodes, signed by that CA.

One directory holds everything a cluster's parties need; each party is given the
CA certificate plus its own files:

    ca.pem, ca.key                the CA; ca.key signs new certificates, keep it off nodes
    controller.pem, .key          server (and etcd client) certificate; SAN 127.0.0.1,
                                  localhost and every --host
    agent.pem, .key               one client certificate for every agent, or
    agent-<NAME>.pem, .key        one per --agent NAME
    operator.pem, .key            client certificate of operators
    reader.pem, .key              client certificate of read-only users
    root.pem, .key                etcd's root user (``keel etcd setup``): the operator's alone
    join.token                    agents' token: may only Connect
    operator.token                every operator call, mutating ones included
    reader.token                  read-only calls

Keys are ECDSA P-256. Private keys and tokens are written 0600, never overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import click
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.keys import NODE_NAME, NODE_NAME_RULE
from common.node_identity import (
    AGENT_CERT_PREFIX,
    NODE_URI_PREFIX,
    SHARED_AGENT_NAME,
    node_uri,
    peer_name,
)
from orchestrator.security.etcd_roles import ROOT

CA_DAYS = 3650
LEAF_DAYS = 365
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
TOKENS = {
    "join": "agents' token: may only call Connect",
    "operator": "operators' token: every call, mutating ones included",
    "reader": "read-only token: status, listings and logs",
}


@dataclass(frozen=True)
class Written:
    path: Path
    mode: int
    what: str


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Keel"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# An agent's: a client of the controller and etcd, and a server to the other agents
# (``agent.peer``), under ``common.node_identity.peer_name``.
AGENT_USAGES = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
# What a party's (not the CA's) key may do: sign its handshakes, agree on keys.
LEAF_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=True,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)


class _Authority:
    def __init__(self, now: datetime.datetime, directory: Path | None = None):
        """A new CA; with ``directory``, the one whose ca.pem and ca.key are there."""
        self.now = now
        if directory is not None:
            self.cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
            self.key = serialization.load_pem_private_key(
                (directory / "ca.key").read_bytes(), password=None
            )
            self.name = self.cert.subject
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        # A random suffix tells this cluster's CA from another's in error messages.
        self.name = _name(f"Keel CA {secrets.token_hex(4)}")
        public = self.key.public_key()
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, common_name: str, usages: list, hosts: tuple[str, ...] = ()
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(minutes=5))
            .not_valid_after(self.now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(LEAF_KEY_USAGE, critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False
            )
        return builder.sign(self.key, hashes.SHA256()), key


class RequestError(ValueError):
    """A certificate request that cannot be signed, and what to fix."""


# Keys a node's certificate request may carry: what every TLS library here speaks.
_CURVES = (ec.SECP256R1, ec.SECP384R1)
MIN_RSA_BITS = 2048


class NodeSigner:
    """The controller's signer of nodes' certificates (TLS bootstrapping), with the
    cluster's CA (``ca.pem`` and ``ca.key``)."""

    def __init__(self, ca_cert: Path, ca_key: Path):
        self.cert = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        self.key = serialization.load_pem_private_key(Path(ca_key).read_bytes(), password=None)
        if self.key.public_key().public_numbers() != self.cert.public_key().public_numbers():
            raise ValueError(f"{ca_key} is not the key of the CA certificate {ca_cert}")

    def check(self, node: str, csr_pem: bytes) -> x509.CertificateSigningRequest:
        """The request, parsed and checked: it names ``node`` (if it names one), its
        signature holds (its sender has the key), and its key is one we sign. Raises
        RequestError with what to fix."""
        if not NODE_NAME.match(node):
            raise RequestError(f"node {node!r}: {NODE_NAME_RULE}")
        try:
            request = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise RequestError(f"csr_pem is not a PEM certificate request: {exc}") from None
        if not request.is_signature_valid:
            raise RequestError("the certificate request's signature does not verify")
        public = request.public_key()
        if isinstance(public, ec.EllipticCurvePublicKey):
            if not isinstance(public.curve, _CURVES):
                raise RequestError(f"curve {public.curve.name}: use P-256 or P-384")
        elif isinstance(public, rsa.RSAPublicKey):
            if public.key_size < MIN_RSA_BITS:
                raise RequestError(f"an RSA key of {public.key_size} bits: use {MIN_RSA_BITS}+")
        else:
            raise RequestError(f"a {type(public).__name__}: use an ECDSA P-256 key")
        try:
            sans = request.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        except x509.ExtensionNotFound:
            return request
        named = [
            u[len(NODE_URI_PREFIX) :]
            for u in sans.value.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(NODE_URI_PREFIX)
        ]
        if any(n != node for n in named):
            raise RequestError(f"the request names node {named[0]}, the call node {node}")
        return request

    def sign(
        self, node: str, request: x509.CertificateSigningRequest, lifetime_s: float, now=None
    ) -> x509.Certificate:
        """``node``'s certificate for the request's key: common name ``keel-agent``
        (etcd's user of every agent), the node in a URI name, and for its peers'
        calls a server's use under ``peer_name(node)`` (``agent.peer``). Nothing
        else of the request is taken. It expires after ``lifetime_s``, or with the CA."""
        now = now or datetime.datetime.now(datetime.UTC)
        until = min(now + datetime.timedelta(seconds=lifetime_s), self.cert.not_valid_after_utc)
        # Valid a little before now, for clocks behind ours: a small share of its
        # lifetime, which is what the agent's renewal is reckoned on.
        skew = datetime.timedelta(seconds=min(300.0, lifetime_s / 20))
        return (
            x509.CertificateBuilder()
            .subject_name(_name(SHARED_AGENT_NAME))
            .issuer_name(self.cert.subject)
            .public_key(request.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - skew)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(LEAF_KEY_USAGE, critical=True)
            .add_extension(x509.ExtendedKeyUsage(AGENT_USAGES), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(node_uri(node)), x509.DNSName(peer_name(node))]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )


def _hosts(extra: tuple[str, ...]) -> tuple[str, ...]:
    hosts = list(DEFAULT_HOSTS)
    for host in extra:
        host = host.strip()
        if not host or any(c in host for c in "/: ") and not _is_ip(host):
            raise ValueError(f"--host {host!r}: give a DNS name or an IP address, no port")
        if host not in hosts:
            hosts.append(host)
    return tuple(hosts)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def plan_files(agents: tuple[str, ...] = ()) -> list[str]:
    """The names ``init`` writes, in order."""
    for name in agents:
        if not NODE_NAME.match(name):
            raise ValueError(
                f"--agent {name!r}: use the agent's node name (1-63 letters, "
                f"digits, '.', '_' or '-', starting with a letter or digit)"
            )
    parties = [
        "ca",
        "controller",
        *([f"agent-{a}" for a in agents] or ["agent"]),
        "operator",
        "reader",
        "root",
    ]
    return [f"{p}.{ext}" for p in parties for ext in ("pem", "key")] + [
        f"{t}.token" for t in TOKENS
    ]


def init(
    directory: Path,
    hosts: tuple[str, ...] = (),
    agents: tuple[str, ...] = (),
    now: datetime.datetime | None = None,
) -> list[Written]:
    """Create the CA, every party's certificate and key, and the three tokens in
    ``directory``; return what was written. Raises FileExistsError, before writing
    anything, if any of those files is there already."""
    agents = tuple(dict.fromkeys(agents))
    names = plan_files(agents)
    sans = _hosts(hosts)
    directory = Path(directory)
    present = [n for n in names if (directory / n).exists()]
    if present:
        raise FileExistsError(
            f"{directory / present[0]} exists; keel certs init never "
            f"overwrites credentials: choose a new directory"
        )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = now or datetime.datetime.now(datetime.UTC)
    ca = _Authority(now)
    until = (now + datetime.timedelta(days=LEAF_DAYS)).date().isoformat()
    written: list[Written] = []

    def write(name: str, data: bytes, mode: int, what: str) -> None:
        path = directory / name
        _write_new(path, data, mode)
        written.append(Written(path, mode, what))

    def party(
        name: str, common_name: str, usages: list, what: str, san: tuple[str, ...] = ()
    ) -> None:
        cert, key = ca.issue(common_name, usages, san)
        sans = f" (SAN {', '.join(san)})" if san else ""
        write(
            f"{name}.pem", _cert_pem(cert), 0o644, f"{what} certificate{sans}, valid until {until}"
        )
        write(f"{name}.key", _key_pem(key), 0o600, f"{what} private key")

    ca_until = (now + datetime.timedelta(days=CA_DAYS)).date().isoformat()
    write(
        "ca.pem",
        _cert_pem(ca.cert),
        0o644,
        f"CA certificate ({ca.name.rfc4514_string()}), valid until {ca_until}",
    )
    write(
        "ca.key",
        _key_pem(ca.key),
        0o600,
        "CA private key: signs certificates; keep it off the nodes",
    )
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    party("controller", "keel-controller", [server, client], "controller", sans)
    if agents:
        for agent in agents:
            # The controller lets this certificate register node `agent` only.
            party(
                f"agent-{agent}",
                AGENT_CERT_PREFIX + agent,
                AGENT_USAGES,
                f"agent {agent}'s",
                (peer_name(agent),),
            )
    else:
        party("agent", "keel-agent", AGENT_USAGES, "every agent's", (peer_name("*"),))
    party("operator", "keel-operator", [client], "operator")
    party("reader", "keel-reader", [client], "read-only")
    # etcd's root user (``keel etcd setup``); Keel's own calls never present it.
    party("root", ROOT, [client], "etcd root's (keep it with the operator, off the nodes)")
    for role, what in TOKENS.items():
        write(f"{role}.token", (secrets.token_urlsafe(32) + "\n").encode(), 0o600, what)
    return written


def init_once(directory: Path, agents: tuple[str, ...] = ()) -> Path:
    """``init`` (certificates of ``agents``, else the shared one), unless ``directory``
    already holds a CA: a rerun of ``keel up --tls`` in the same workdir reuses its
    credentials, and that CA signs those it lacks (a node more, or the etcd root
    certificate of a workdir older than ``keel etcd setup``)."""
    directory = Path(directory)
    if not (directory / "ca.pem").exists():
        init(directory, agents=agents)
        return directory
    missing = [a for a in agents if not (directory / f"agent-{a}.pem").exists()]
    add(directory, missing, root=not (directory / "root.pem").exists())
    return directory


def add(directory: Path, agents: list[str], root: bool = False) -> list[Written]:
    """Sign a certificate per agent of ``agents`` (and etcd root's, with ``root``)
    with the CA in ``directory`` (its ca.pem and ca.key), written there; raises
    FileExistsError, before writing anything, if any is there already, and
    ValueError for a name no node may have."""
    directory = Path(directory)
    agents = list(dict.fromkeys(agents))
    plan_files(tuple(agents))  # the names' check
    parties = [
        (f"agent-{a}", AGENT_CERT_PREFIX + a, f"agent {a}'s", AGENT_USAGES, (peer_name(a),))
        for a in agents
    ]
    if root:
        parties.append(
            (
                "root",
                ROOT,
                "etcd root's (keep it with the operator, off the nodes)",
                [ExtendedKeyUsageOID.CLIENT_AUTH],
                (),
            )
        )
    present = [
        f"{name}.{ext}"
        for name, *_ in parties
        for ext in ("pem", "key")
        if (directory / f"{name}.{ext}").exists()
    ]
    if present:
        raise FileExistsError(
            f"{directory / present[0]} exists; keel certs never overwrites credentials"
        )
    now = datetime.datetime.now(datetime.UTC)
    until = (now + datetime.timedelta(days=LEAF_DAYS)).date().isoformat()
    ca = _Authority(now, directory) if parties else None
    written = []
    for name, common_name, what, usages, hosts in parties:
        cert, key = ca.issue(common_name, usages, hosts)
        for path, data, mode, kind in (
            (
                directory / f"{name}.pem",
                _cert_pem(cert),
                0o644,
                f"certificate, valid until {until}",
            ),
            (directory / f"{name}.key", _key_pem(key), 0o600, "private key"),
        ):
            _write_new(path, data, mode)
            written.append(Written(path, mode, f"{what} {kind}"))
    return written


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, mode)  # the umask may have narrowed a 0644


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def certs():
    """Certificates, keys and tokens for mutual TLS and roles."""


@certs.command("init", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--host",
    "hosts",
    multiple=True,
    metavar="HOST",
    help="Repeatable: a DNS name or IP address agents and operators reach the "
    "controller on (its --advertise-host); added to 127.0.0.1 and localhost "
    "in the controller certificate.",
)
@click.option(
    "--agent",
    "agents",
    multiple=True,
    metavar="NAME",
    help="Repeatable: write a certificate per agent node NAME "
    "(agent-NAME.pem/.key) instead of one shared by every agent.",
)
def init_command(directory, hosts, agents):
    """Create a CA, certificates and keys for the controller, agents, operators,
    readers and etcd's root (root.pem, for `keel etcd setup`), and the join, operator
    and reader tokens, in DIRECTORY.

    Give each party ca.pem and its own files; then run `keel controller --tls-dir`,
    `keel agent --tls-dir` and `keel status --tls-dir` with that directory.
    """
    try:
        written = init(Path(directory), tuple(hosts), tuple(agents))
    except (ValueError, FileExistsError) as exc:
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:  # e.g. DIRECTORY under a file, or not writable
        raise click.ClickException(str(exc)) from exc
    width = max(len(str(w.path)) for w in written)
    for w in written:
        click.echo(f"wrote {str(w.path):<{width}}  {w.mode:04o}  {w.what}")


@certs.command("add", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--agent",
    "agents",
    multiple=True,
    required=True,
    metavar="NAME",
    help="Repeatable: sign agent-NAME.pem/.key for agent node NAME.",
)
def add_command(directory, agents):
    """Sign certificates for more agent nodes with the CA in DIRECTORY (written by
    `keel certs init`; its ca.key is needed), then give each its etcd user with
    `keel etcd setup --agent NAME`."""
    try:
        written = add(Path(directory), list(agents))
    except (ValueError, FileExistsError) as exc:
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:  # no ca.key there, say
        raise click.ClickException(str(exc)) from exc
    width = max(len(str(w.path)) for w in written)
    for w in written:
        click.echo(f"wrote {str(w.path):<{width}}  {w.mode:04o}  {w.what}")
