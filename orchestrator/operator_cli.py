"""Read-only operator commands: ``keel status``, ``keel nodes``, ``keel jobs``,
``keel events``. Each reaches the controller like any client (address, token) and
prints a table, or JSON with ``--json``."""

from __future__ import annotations

import json
import time

import click
import grpc
from google.protobuf import json_format

from orchestrator import tls
from orchestrator.auth import call_metadata
from orchestrator.store import Store, connect
from protos import keel_pb2, keel_pb2_grpc

RPC_TIMEOUT_S = 10.0
FOLLOW_POLL_S = 1.0


def connection_options(command):
    """The options every operator command takes to reach the controller."""
    command = click.option(
        "--controller", envvar="KEEL_CONTROLLER", default=None,
        help="Controller host:port (env KEEL_CONTROLLER); default: the leader "
             "published in etcd.")(command)
    command = click.option(
        "--etcd-endpoints", envvar="KEEL_ETCD_ENDPOINTS", default=None,
        help="etcd host:port list to find the controller in (env KEEL_ETCD_ENDPOINTS).")(command)
    command = click.option(
        "--token-file", type=click.Path(exists=True, dir_okay=False), default=None,
        help="File holding your token: the operator or reader token, or the controller's "
             "only one (else --tls-dir's operator.token or reader.token, else env "
             "KEEL_TOKEN).")(command)
    command = tls.tls_options("operator (or reader)",
                              "ca.pem and operator.pem/.key/.token, or if it has none, "
                              "reader.pem/.key/.token")(command)
    command = tls.etcd_options(command)
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON instead of a table.")(command)


class Client:
    def __init__(self, controller: str | None, etcd_endpoints: str | None,
                 token_file: str | None, **security):
        try:
            token, tls_files, etcd_credentials = tls.client_settings(token_file, security)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        if not token:
            raise click.UsageError("give --token-file, --tls-dir or set KEEL_TOKEN")
        if not controller:
            if not etcd_endpoints:
                raise click.UsageError("give --controller HOST:PORT, or --etcd-endpoints to "
                                       "find the leader")
            endpoints = [e.strip() for e in etcd_endpoints.split(",") if e.strip()]
            try:
                controller = Store(connect(endpoints, RPC_TIMEOUT_S,
                                           etcd_credentials)).controller_address()
            except grpc.RpcError as exc:  # e.g. PERMISSION_DENIED: etcd user or password
                raise click.ClickException(f"etcd at {etcd_endpoints}: {exc.code().name}: "
                                           f"{exc.details()}") from None
            except Exception as exc:  # etcd3's ConnectionFailedError and kin
                raise click.ClickException(f"etcd at {etcd_endpoints}: {exc}; check "
                                           f"--etcd-endpoints and the --etcd-* "
                                           f"credentials") from None
            if not controller:
                raise click.ClickException(f"no controller is published in etcd at "
                                           f"{etcd_endpoints}; is one running?")
        self.channel = tls.channel(controller, tls_files)
        self.stub = keel_pb2_grpc.ControllerStub(self.channel)
        self.metadata = call_metadata(token)
        self.address = controller

    def call(self, method: str, request):
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata,
                                              timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"controller at {self.address} did not answer within "
                                   f"{RPC_TIMEOUT_S:.0f} s") from None
            raise click.ClickException(f"{err.code().name}: {err.details()}") from None


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _job_row(job: keel_pb2.JobStatus) -> list[str]:
    generation = job.generation
    stragglers = sorted({e.node for e in job.events
                         if e.kind == "straggler" and e.generation == generation})
    return [job.job, job.state, str(generation), str(job.world_size), job.mesh or "-",
            f"{job.step}/{job.target_steps}" if job.target_steps else str(job.step),
            f"{job.loss:.4f}" if job.has_loss else "-", f"{job.tokens_per_s:,.0f}",
            str(job.restarts), ",".join(stragglers) or "-",
            str(job.last_checkpoint.step) if job.HasField("last_checkpoint") else "-"]


JOB_HEADERS = ["JOB", "STATE", "GEN", "WORLD", "LAYOUT", "STEP", "LOSS", "TOK/S",
               "RESTARTS", "STRAGGLERS", "CHECKPOINT"]


def _event_line(event: keel_pb2.Event) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event.at))
    rank = f" rank {event.rank}" if event.HasField("rank") else ""
    return (f"{when}  gen {event.generation}  {event.kind:<9} {event.node or '-'}{rank} "
            f"step {event.step}: {event.reason}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@connection_options
def status(controller, etcd_endpoints, token_file, as_json, **security):
    """The controller, its nodes and every job at a glance."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    nodes = client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
    jobs = client.call("ListJobs", keel_pb2.ListJobsRequest()).jobs
    if as_json:
        click.echo(json.dumps({"controller": client.address,
                               "nodes": [_dict(n) for n in nodes],
                               "jobs": [_dict(j) for j in jobs]}))
        return
    connected = sum(1 for n in nodes if n.connected)
    click.echo(f"controller {client.address}: {connected}/{len(nodes)} nodes connected, "
               f"{sum(n.slots for n in nodes if n.connected)} slots, {len(jobs)} job(s)")
    if jobs:
        click.echo(_table(JOB_HEADERS, [_job_row(j) for j in jobs]))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@connection_options
def nodes(controller, etcd_endpoints, token_file, as_json, **security):
    """Registered nodes: host, slots, whether their agent is connected, their lease."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    found = client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
    if as_json:
        click.echo(json.dumps([_dict(n) for n in found]))
        return
    click.echo(_table(["NODE", "HOST", "SLOTS", "CONNECTED", "LEASE"],
                      [[n.node, n.host, str(n.slots), "yes" if n.connected else "no",
                        f"{n.lease_id:x}"] for n in found]))


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
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing new events until the job ends (or Ctrl-C).")
@connection_options
def events(job, follow, controller, etcd_endpoints, token_file, as_json, **security):
    """A job's detections and actions (crash, hang, straggler, node_lost, replaced,
    excluded, cordoned, alert), oldest first."""
    client = Client(controller, etcd_endpoints, token_file, **security)
    shown = 0
    while True:
        status_ = client.call("GetJob", keel_pb2.GetJobRequest(job=job))
        for event in status_.events[shown:]:
            click.echo(json.dumps(_dict(event)) if as_json else _event_line(event))
        shown = len(status_.events)
        if not follow or status_.state in ("SUCCEEDED", "FAILED"):
            return
        time.sleep(FOLLOW_POLL_S)
