"""``keel etcd setup``: etcd's users and roles for Keel (``orchestrator.security.etcd_roles``),
then etcd's auth enabled.

Run once per etcd cluster, as etcd's ``root`` (``root.pem`` of ``keel certs init``),
against an etcd that takes only clients with certificates of Keel's CA
(``--client-cert-auth``): each party's certificate names its user. It is safe to run
again (to add agents): what exists is kept, what is missing
is added. Users get a random password nobody holds: they log in by certificate only,
which is why it refuses an etcd that answers clients without a certificate (auth on
there would lock everyone out, root included).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import click
import etcd3
import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from common import env, flags, keys
from common.etcd import EtcdClient, EtcdCredentials, connect, etcd_credentials
from orchestrator.security.etcd_roles import ROOT, Role, roles

CONTEXT = {"help_option_names": ["-h", "--help"]}
CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Done:
    """What ``apply`` did: each user, role or grant, and whether it was new."""

    what: str
    new: bool


def _call(client: EtcdClient, method: str, request) -> bool:
    """Call etcd's Auth ``method``; False where what it adds exists already."""
    try:
        getattr(client.authstub, method)(
            request,
            client.timeout,
            credentials=client.call_credentials,
            metadata=client.metadata,
        )
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.FAILED_PRECONDITION and "already exists" in (
            exc.details() or ""
        ):
            return False
        raise
    return True


def _user(client: EtcdClient, name: str, role: str, done: list[Done]) -> None:
    password = secrets.token_urlsafe(32)  # never kept: the certificate is the login
    added = _call(client, "UserAdd", etcdrpc.AuthUserAddRequest(name=name, password=password))
    done.append(Done(f"user {name}", added))
    _call(client, "UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=name, role=role))


def apply(client: EtcdClient, wanted: tuple[Role, ...]) -> list[Done]:
    """Create root and every role of ``wanted`` with its user, grant their permissions,
    and enable etcd's auth; ``client`` must be etcd's root once auth is on."""
    done: list[Done] = []
    _user(client, ROOT, ROOT, done)  # etcd enables auth only with a root user
    for role in wanted:
        added = _call(client, "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role.name))
        done.append(Done(f"role {role.name}", added))
        for grant in role.grants:
            permission = auth_pb2.Permission(
                permType=grant.access.value,
                key=grant.key.encode(),
                range_end=grant.range_end.encode(),
            )
            _call(
                client,
                "RoleGrantPermission",
                etcdrpc.AuthRoleGrantPermissionRequest(name=role.name, perm=permission),
            )
        _user(client, role.name, role.name, done)
    _call(client, "AuthEnable", etcdrpc.AuthEnableRequest())
    return done


def takes_clients_without_a_certificate(endpoints: list[str], ca: Path) -> bool:
    """Whether etcd answers a client that presents no certificate: then it does not run
    with ``--client-cert-auth``, certificates name no user, and enabling auth would
    lock every party out (their passwords are thrown away), root included."""
    probe = connect(endpoints, CALL_TIMEOUT_S, EtcdCredentials(ca=ca))
    try:
        probe.get(keys.LEADER)
    except etcd3.exceptions.ConnectionFailedError:
        return False  # the handshake failed: it wants a certificate (or is down)
    except grpc.RpcError:
        return True  # it answered, if only to refuse
    finally:
        probe.close()
    return True


def describe(role: Role) -> str:
    parts = [
        f"{grant.access.name.lower()} {grant.key}{'*' if grant.range_end else ''}"
        for grant in role.grants
    ]
    return f"{role.name}: {', '.join(parts)}"


@click.group(context_settings=CONTEXT)
def etcd():
    """etcd's users and roles for Keel."""


@etcd.command("setup", context_settings=CONTEXT)
@click.option(
    "--etcd-endpoints",
    required=True,
    envvar=env.ETCD_ENDPOINTS,
    help="Comma-separated host:port list of etcd (env KEEL_ETCD_ENDPOINTS).",
)
@click.option(
    "--agent",
    "agents",
    multiple=True,
    metavar="NAME",
    help="Repeatable: a user and role for agent node NAME (its certificate "
    "agent-NAME.pem of `keel certs init --agent NAME`), which may write its own "
    "node key only; without any, one role for the certificate every agent shares.",
)
@flags.etcd_options
def setup_command(etcd_endpoints, agents, **security):
    """Create etcd's users and roles for Keel and enable etcd's auth.

    Give etcd's root certificate: --etcd-ca ca.pem --etcd-cert root.pem --etcd-key
    root.key of `keel certs init`. The controller's and operators' users may read and
    write every key under /keel/; an agent's may read the leader key and write its own
    node key. Each party's certificate names its user. Run it again to add agents.
    """
    endpoints = [e.strip() for e in etcd_endpoints.split(",") if e.strip()]
    where = f"etcd at {', '.join(endpoints) or '(none)'}"
    try:
        credentials = etcd_credentials(**security)
        wanted = roles(tuple(agents))
        if credentials is None or credentials.cert is None:
            raise ValueError(
                "give etcd's root certificate: --etcd-ca ca.pem --etcd-cert root.pem "
                "--etcd-key root.key (the users it makes log in by certificate only)"
            )
        if takes_clients_without_a_certificate(endpoints, credentials.ca):
            raise click.ClickException(
                f"{where} answers clients without a certificate: run it with "
                f"--client-cert-auth --trusted-ca-file ca.pem, so that each certificate "
                f"names its user; auth is not enabled"
            )
        client = connect(endpoints, CALL_TIMEOUT_S, credentials)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        done = apply(client, wanted)
    except grpc.RpcError as exc:
        raise click.ClickException(
            f"{where} refused: {exc.code().name}: {exc.details()}; give etcd's root "
            f"certificate (--etcd-cert root.pem --etcd-key root.key)"
        ) from None
    except etcd3.exceptions.Etcd3Exception as exc:
        raise click.ClickException(
            f"cannot reach {where} ({type(exc).__name__}); check --etcd-endpoints"
        ) from None
    finally:
        client.close()
    for item in done:
        click.echo(f"{'created' if item.new else 'kept   '} {item.what}")
    for role in wanted:
        click.echo(f"  {describe(role)}")
    click.echo(f"auth enabled in {where}")
