"""Operator commands. Read-only: ``keel status``, ``keel nodes``, ``keel jobs``,
``keel events``. Mutating (the operator token): ``keel cordon``, ``keel uncordon``,
``keel drain``, ``keel replace``, ``keel checkpoint``, ``keel submit``, ``keel stop``.
Each reaches the controller like any client (address, token) and prints a table or a
sentence, or JSON with ``--json``."""

from __future__ import annotations

import collections
import json
import time

import click
import grpc

import common.wire_kinds  # noqa: F401  its mirrors, for message_dict (JobStatus.preflight)
from common import env, flags
from common.proto_enums import message_dict
from orchestrator.cli.client import RPC_TIMEOUT_S, ControllerClient, NoController
from orchestrator.policy.event_kind import WIRE_EVENT_KINDS, EventKind
from orchestrator.policy.lifecycle import WIRE_STATES
from orchestrator.policy.node_state import WIRE_NODE_STATES
from orchestrator.security import tls
from protos import keel_pb2

FOLLOW_POLL_S = 1.0
STRAGGLER = WIRE_EVENT_KINDS.to_wire(EventKind.STRAGGLER)  # Event.kind of a slow node
CONTEXT = {"help_option_names": ["-h", "--help"]}


def connection_options(command=None, *, with_json: bool = True):
    """The options every operator command takes to reach the controller (and
    ``--json``, unless ``with_json`` is off)."""
    if command is None:
        return lambda command: connection_options(command, with_json=with_json)
    command = click.option(
        "--controller",
        envvar=env.CONTROLLER,
        default=None,
        help="Controller host:port (env KEEL_CONTROLLER); default: the leader published in etcd.",
    )(command)
    command = click.option(
        "--etcd-endpoints",
        envvar=env.ETCD_ENDPOINTS,
        default=None,
        help="etcd host:port list to find the controller in (env KEEL_ETCD_ENDPOINTS).",
    )(command)
    command = click.option(
        "--token-file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="File holding your token: the operator or reader token, or the controller's "
        "only one (else --tls-dir's operator.token or reader.token, else env "
        "KEEL_TOKEN).",
    )(command)
    command = flags.tls_options(
        "operator (or reader)",
        "ca.pem and operator.pem/.key/.token, or if it has none, reader.pem/.key/.token",
    )(command)
    command = flags.etcd_options(command)
    if not with_json:
        return command
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(
        command
    )


class Client:
    """The operator's ``ControllerClient``: a failover in progress is waited out for up
    to ``RPC_TIMEOUT_S``; every error ends the command with what to check."""

    def __init__(
        self, controller: str | None, etcd_endpoints: str | None, token_file: str | None, **security
    ):
        try:
            token, tls_files, etcd_credentials = tls.client_settings(token_file, security)
            if not token:
                raise ValueError("give --token-file, --tls-dir or set KEEL_TOKEN")
            self.etcd_endpoints = etcd_endpoints
            self.client = ControllerClient(
                token,
                controller=controller,
                tls_files=tls_files,
                etcd_endpoints=[e.strip() for e in (etcd_endpoints or "").split(",") if e.strip()],
                etcd_credentials=etcd_credentials,
                wait_s=RPC_TIMEOUT_S,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc

    @property
    def address(self) -> str | None:
        return self.client.address

    def call(self, method: str, request):
        try:
            return self.client.call(method, request)
        except NoController as exc:
            where = f"etcd at {self.etcd_endpoints}"
            if exc.etcd_error is not None:
                raise click.ClickException(f"{where}: {exc}") from None
            if exc.unpublished:
                raise click.ClickException(
                    f"no controller is published in {where}; is one running?"
                ) from None
            raise click.ClickException(
                f"{where}: {exc}; check --etcd-endpoints and the --etcd-* credentials"
            ) from None
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise click.ClickException(
                    f"controller at {self.address} did not answer within {RPC_TIMEOUT_S:.0f} s"
                ) from None
            raise click.ClickException(f"{err.code().name}: {err.details()}") from None


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _dict(message) -> dict:
    return message_dict(message)


def _job_row(job: keel_pb2.JobStatus) -> list[str]:
    generation = job.generation
    stragglers = sorted(
        {e.node for e in job.events if e.kind == STRAGGLER and e.generation == generation}
    )
    return [
        job.job,
        WIRE_STATES.text(job.state),
        str(generation),
        str(job.world_size),
        job.mesh or "-",
        f"{job.step}/{job.target_steps}" if job.target_steps else str(job.step),
        f"{job.loss:.4f}" if job.has_loss else "-",
        f"{job.step_time_s * 1000:.0f} ms" if job.step_time_s else "-",
        f"{job.tokens_per_s:,.0f}",
        str(job.restarts),
        ",".join(stragglers) or "-",
        str(job.last_checkpoint.step) if job.HasField("last_checkpoint") else "-",
        str(job.last_memory_snapshot.step) if job.HasField("last_memory_snapshot") else "-",
    ]


JOB_HEADERS = [
    "JOB",
    "STATE",
    "GEN",
    "WORLD",
    "LAYOUT",
    "STEP",
    "LOSS",
    "STEP TIME",
    "TOK/S",
    "RESTARTS",
    "STRAGGLERS",
    "CHECKPOINT",
    "MEMORY",
]


def _event_line(event: keel_pb2.Event) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.at))
    rank = f" rank {event.rank}" if event.HasField("rank") else ""
    kind = WIRE_EVENT_KINDS.text(event.kind)
    return (
        f"{when}  gen {event.generation}  {kind:<9} {event.node or '-'}{rank} "
        f"step {event.step}: {event.reason}"
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@connection_options
def status(controller, etcd_endpoints, token_file, as_json, **security):
    """The controller, its nodes and every job at a glance."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    nodes = client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
    jobs = client.call("ListJobs", keel_pb2.ListJobsRequest()).jobs
    if as_json:
        click.echo(
            json.dumps(
                {
                    "controller": client.address,
                    "nodes": [_dict(n) for n in nodes],
                    "jobs": [_dict(j) for j in jobs],
                }
            )
        )
        return
    connected = sum(1 for n in nodes if n.connected)
    held = collections.Counter(
        WIRE_NODE_STATES.text(n.state) for n in nodes if n.state != keel_pb2.NODE_STATE_READY
    )
    click.echo(
        f"controller {client.address}: {connected}/{len(nodes)} nodes connected, "
        f"{sum(n.slots for n in nodes if n.connected)} slots, {len(jobs)} job(s)"
        + "".join(f", {count} {state}" for state, count in sorted(held.items()))
    )
    if jobs:
        click.echo(_table(JOB_HEADERS, [_job_row(j) for j in jobs]))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@connection_options
def nodes(controller, etcd_endpoints, token_file, as_json, **security):
    """Registered (and cordoned) nodes: host, slots, whether their agent is connected,
    state (ready, cordoned, draining, drained), the job on them, their lease."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    found = client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
    if as_json:
        click.echo(json.dumps([_dict(n) for n in found]))
        return
    click.echo(
        _table(
            ["NODE", "HOST", "SLOTS", "CONNECTED", "STATE", "JOB", "LEASE", "WHY"],
            [
                [
                    n.node,
                    n.host or "-",
                    str(n.slots),
                    "yes" if n.connected else "no",
                    WIRE_NODE_STATES.text(n.state),
                    n.job or "-",
                    f"{n.lease_id:x}" if n.lease_id else "-",
                    n.cordon_reason or "-",
                ]
                for n in found
            ],
        )
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@connection_options
def jobs(controller, etcd_endpoints, token_file, as_json, **security):
    """Every job: state, generation, world size, layout, step, loss, stragglers, last
    checkpoint."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    found = client.call("ListJobs", keel_pb2.ListJobsRequest()).jobs
    if as_json:
        click.echo(json.dumps([_dict(j) for j in found]))
        return
    click.echo(_table(JOB_HEADERS, [_job_row(j) for j in found]))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("job")
@click.option(
    "--follow", "-f", is_flag=True, help="Keep printing new events until the job ends (or Ctrl-C)."
)
@connection_options
def events(job, follow, controller, etcd_endpoints, token_file, as_json, **security):
    """A job's detections and actions (crash, hang, straggler, node_lost,
    agent_restarted, replaced, excluded, cordoned, alert, operator), oldest first."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    shown = 0  # the last event's seq
    while True:
        status_ = client.call("GetJob", keel_pb2.GetJobRequest(job=job))
        for event in status_.events:
            if event.seq > shown:
                click.echo(json.dumps(_dict(event)) if as_json else _event_line(event))
        shown = max([shown, *(e.seq for e in status_.events)])
        if not follow or WIRE_STATES.from_wire(status_.state).terminal:
            return
        time.sleep(FOLLOW_POLL_S)


# ============================================================ mutating commands
def _wait(what: str, timeout_s: float, check):
    """Poll ``check`` until it returns a value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"gave up waiting for {what} after {timeout_s:.0f} s "
                f"(it goes on; `keel status` shows where it is)"
            )
        time.sleep(FOLLOW_POLL_S)


def _node_reply(reply: keel_pb2.NodeReply, as_json: bool) -> None:
    click.echo(json.dumps(_dict(reply)) if as_json else reply.message)


wait_option = click.option("--wait", is_flag=True, help="Return only once it is done.")
timeout_option = click.option(
    "--timeout-s",
    type=float,
    default=600,
    show_default=True,
    help="With --wait: give up after this long.",
)
reason_option = click.option("--reason", default="", help="Why; recorded and shown.")


@click.command(context_settings=CONTEXT)
@click.argument("node")
@reason_option
@connection_options
def cordon(node, reason, controller, etcd_endpoints, token_file, as_json, **security):
    """Place no new generation on NODE; what runs there keeps running."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    _node_reply(client.call("CordonNode", keel_pb2.NodeRequest(node=node, reason=reason)), as_json)


@click.command(context_settings=CONTEXT)
@click.argument("node")
@connection_options
def uncordon(node, controller, etcd_endpoints, token_file, as_json, **security):
    """Let new generations on NODE again (a drain in progress is called off)."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    _node_reply(client.call("UncordonNode", keel_pb2.NodeRequest(node=node)), as_json)


@click.command(context_settings=CONTEXT)
@click.argument("node")
@reason_option
@wait_option
@timeout_option
@connection_options
def drain(
    node, reason, wait, timeout_s, controller, etcd_endpoints, token_file, as_json, **security
):
    """Move every job off NODE gracefully and keep new ones off it: cordon, checkpoint
    now, and the next generation runs on a free node (or on a re-planned smaller
    layout if the job's min_nodes allows). NODE is drained once nothing runs there."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("DrainNode", keel_pb2.NodeRequest(node=node, reason=reason))
    if wait and reply.node.state != keel_pb2.NODE_STATE_DRAINED:
        if not as_json:
            click.echo(reply.message)

        def drained():
            found = [
                n
                for n in client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
                if n.node == node
            ]
            if found and found[0].state == keel_pb2.NODE_STATE_DRAINING:
                return None
            return found or [None]

        info = _wait(f"{node} to drain", timeout_s, drained)[0]
        if info is None or info.state != keel_pb2.NODE_STATE_DRAINED:
            shown = "gone" if info is None else WIRE_NODE_STATES.text(info.state)
            raise click.ClickException(
                f"{node} is {shown}, not drained (uncordoned while draining?)"
            )
        reply = keel_pb2.NodeReply(node=info, message=f"{node} drained")
    _node_reply(reply, as_json)


@click.command(context_settings=CONTEXT)
@click.argument("node")
@click.option(
    "--with",
    "with_node",
    default="",
    metavar="NODE",
    help="The free node to take its place (default: any free node).",
)
@connection_options
def replace(node, with_node, controller, etcd_endpoints, token_file, as_json, **security):
    """Checkpoint the job on NODE now, then run its next generation with NODE replaced
    (by --with NODE, or any free node). NODE is not cordoned."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    _node_reply(
        client.call("ReplaceNode", keel_pb2.ReplaceNodeRequest(node=node, with_node=with_node)),
        as_json,
    )


@click.command(context_settings=CONTEXT)
@click.argument("job", required=False, default="")
@wait_option
@timeout_option
@connection_options
def checkpoint(job, wait, timeout_s, controller, etcd_endpoints, token_file, as_json, **security):
    """Ask JOB (default: the only running job) for a checkpoint at its next step."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("CheckpointJob", keel_pb2.CheckpointJobRequest(job=job))
    if not wait:
        click.echo(
            json.dumps(_dict(reply))
            if as_json
            else f"job {reply.job} checkpoints after step {reply.after_step}"
        )
        return

    def committed():
        status_ = client.call("GetJob", keel_pb2.GetJobRequest(job=reply.job))
        ck = status_.last_checkpoint
        if status_.HasField("last_checkpoint") and ck.step > reply.after_step:
            return ck
        if WIRE_STATES.from_wire(status_.state).terminal or status_.generation != reply.generation:
            raise click.ClickException(
                f"job {reply.job} is {WIRE_STATES.text(status_.state)} in generation "
                f"{status_.generation}; no checkpoint after step "
                f"{reply.after_step} was committed"
            )
        return None

    ck = _wait(f"job {reply.job}'s checkpoint", timeout_s, committed)
    click.echo(
        json.dumps(_dict(ck))
        if as_json
        else f"job {reply.job}: checkpoint committed at step {ck.step}: {ck.path}"
    )


@click.command(context_settings=CONTEXT)
@click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option(
    "--check",
    is_flag=True,
    help="Only validate SPEC and print the job spec; contact no controller.",
)
@connection_options
def submit(spec_file, check, controller, etcd_endpoints, token_file, as_json, **security):
    """Submit the job described in SPEC, a TOML or YAML file of JobSpec fields (name,
    world_size, command, env, max_restarts, steps, checkpoint_dir, mesh, min_nodes,
    model, training, health, resume_from, on_no_checkpoint). Every problem is reported
    with its field and the fix. A checkpoint_dir another job in etcd names is refused:
    to start from that job's checkpoints, give resume_from and a directory of its own."""
    from orchestrator.spec.specfile import SpecFileError, load

    try:
        spec = load(spec_file)
    except SpecFileError as exc:
        raise click.ClickException(f"{spec_file} is not a valid job spec:\n{exc}") from None
    if check:
        click.echo(
            json.dumps(_dict(spec))
            if as_json
            else f"{spec_file}: valid; job {spec.name} on {spec.world_size} rank(s)"
        )
        return
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("SubmitJob", keel_pb2.SubmitJobRequest(spec=spec))
    click.echo(
        json.dumps(_dict(reply))
        if as_json
        else f"submitted job {reply.job} ({spec.world_size} ranks); follow it with "
        f"`keel events -f {reply.job}`"
    )


@click.command(context_settings=CONTEXT)
@click.argument("job")
@click.option("--now", is_flag=True, help="Stop at once, without a final checkpoint.")
@reason_option
@wait_option
@timeout_option
@connection_options
def stop(
    job, now, reason, wait, timeout_s, controller, etcd_endpoints, token_file, as_json, **security
):
    """Stop JOB for good: checkpoint now (unless --now), stop every rank, and end the
    job CANCELLED."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("StopJob", keel_pb2.StopJobRequest(job=job, now=now, reason=reason))
    if wait:
        if not as_json:
            click.echo(reply.message)

        def ended():
            found = client.call("GetJob", keel_pb2.GetJobRequest(job=job))
            return found if WIRE_STATES.from_wire(found.state).terminal else None

        status_ = _wait(f"job {job} to stop", timeout_s, ended)
        shown = WIRE_STATES.text(status_.state)
        reply = keel_pb2.StopJobReply(
            job=job, state=status_.state, message=f"job {job} {shown}: {status_.reason}"
        )
    click.echo(json.dumps(_dict(reply)) if as_json else reply.message)


@click.command(context_settings=CONTEXT)
@click.argument("job")
@connection_options
def delete(job, controller, etcd_endpoints, token_file, as_json, **security):
    """Forget JOB, which has ended: its records go from etcd (spec, state, plans, events,
    checkpoint records). Its checkpoint directory is left as it is. A job that still
    runs is refused: `keel stop` it first. Ended jobs are also deleted on their own
    after the controller's --finished-job-ttl-s."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("DeleteJob", keel_pb2.DeleteJobRequest(job=job))
    click.echo(json.dumps(_dict(reply)) if as_json else reply.message)


# `keel certs approve|revoke|list`: nodes' own certificates (TLS bootstrapping).
def _certificate_reply(reply: keel_pb2.CertificateStatus, as_json: bool) -> None:
    click.echo(json.dumps(_dict(reply)) if as_json else reply.message)


@click.command("approve", context_settings=CONTEXT)
@click.argument("node")
@connection_options
def certs_approve(node, controller, etcd_endpoints, token_file, as_json, **security):
    """Let NODE be signed its own certificate: its waiting request (a controller with
    --approve-agents), or, for a node with none or one revoked, the next request."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("ApproveCertificate", keel_pb2.NodeRequest(node=node))
    _certificate_reply(reply, as_json)


@click.command("revoke", context_settings=CONTEXT)
@click.argument("node")
@connection_options
def certs_revoke(node, controller, etcd_endpoints, token_file, as_json, **security):
    """Revoke NODE's certificate: its agent's session is closed now, and no Hello or
    certificate request for NODE is accepted until `keel certs approve NODE`."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    reply = client.call("RevokeCertificate", keel_pb2.NodeRequest(node=node))
    _certificate_reply(reply, as_json)


@click.command("list", context_settings=CONTEXT)
@connection_options
def certs_list(controller, etcd_endpoints, token_file, as_json, **security):
    """Nodes' own certificates: state (pending, approved, issued, revoked), serial,
    expiry, how many were signed, and who made the last change."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    found = client.call("ListCertificates", keel_pb2.ListCertificatesRequest()).certificates
    if as_json:
        click.echo(json.dumps([_dict(c) for c in found]))
        return
    click.echo(
        _table(
            ["NODE", "STATE", "SERIAL", "EXPIRES", "SIGNED", "KEY", "BY"],
            [
                [
                    c.node,
                    c.state,
                    c.serial[:16] or "-",
                    time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c.not_after_unix))
                    if c.not_after_unix
                    else "-",
                    str(c.issued),
                    c.key_sha256[:16] or "-",
                    c.by or "-",
                ]
                for c in found
            ],
        )
    )


CERTS = (certs_approve, certs_revoke, certs_list)
MUTATING = (cordon, uncordon, drain, replace, checkpoint, submit, stop, delete)
