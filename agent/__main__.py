"""``python -m agent`` (also ``keel agent``): run a node agent in the foreground."""

from __future__ import annotations

import os
from pathlib import Path

import click

from agent.bootstrap import CertificateRefused, Identity, Renewer, bootstrap
from agent.config import AgentConfig, security_settings
from agent.daemon import run
from agent.leftovers import RunDirInUse
from agent.rank_user import RankUser, RankUserRefused
from agent.warm import DEFAULT_IMPORTS
from common import env, flags, net
from common.logs import configure
from common.tls import read_token


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--node", required=True, help="Unique name of this node.")
@click.option(
    "--slots",
    type=int,
    required=True,
    help="Rank processes this node can run (usually its GPU count).",
)
@click.option(
    "--etcd-endpoints",
    required=True,
    help="Comma-separated etcd host:port list (env KEEL_ETCD_ENDPOINTS).",
    envvar=env.ETCD_ENDPOINTS,
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the join token, or the controller's only token (else "
    "--tls-dir's join.token, else env KEEL_TOKEN).",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=".keel/agent",
    show_default=True,
    help="Where rank logs and error files go.",
)
@click.option(
    "--host",
    default=None,
    help="Address other nodes reach this node's ranks on (default: this "
    "machine's address on the route to etcd; a loopback one is refused when "
    "etcd is remote).",
)
@click.option(
    "--rendezvous-ports",
    metavar="LOW-HIGH",
    default=None,
    help="Take the rendezvous port of a generation whose rank 0 runs here from "
    "this range (for a firewall); default: any free port.",
)
@click.option(
    "--controller",
    default=None,
    help="Controller host:port; default: discover the leader through etcd.",
)
@click.option(
    "--lease-ttl-s",
    type=float,
    default=5.0,
    show_default=True,
    help="TTL of the node's etcd lease: a dead node is noticed after this.",
)
@click.option(
    "--drain-timeout-s",
    type=float,
    default=60.0,
    show_default=True,
    help="On SIGTERM while running ranks, move the job off this node around a "
    "checkpoint (as `keel drain` does) for at most this long, then stop. "
    "SIGINT, or a second SIGTERM, stops at once.",
)
@click.option(
    "--stop-grace-s",
    type=float,
    default=5.0,
    show_default=True,
    help="SIGTERM to SIGKILL grace when the agent shuts down (a job's ranks are "
    "stopped with the job's own stop grace).",
)
@flags.metrics_options("--host", ", its ranks' included")
@click.option(
    "--accelerator",
    default="",
    help="What this node's slots are, for the job's MFU (e.g. 'NVIDIA H100 80GB "
    "HBM3'); default: the first GPU nvidia-smi names, else 'cpu'.",
)
@click.option(
    "--warm-processes/--no-warm-processes",
    default=True,
    show_default=True,
    help="Keep one process per slot that has started Python and imported torch "
    "(and created its GPU's CUDA context), for restarted ranks to start "
    "from; a job can still ask for cold starts (JobSpec cold_start).",
)
@click.option(
    "--warm-imports",
    default=",".join(DEFAULT_IMPORTS),
    show_default=True,
    metavar="MODULE,...",
    help="What the warm processes import ahead of their ranks (add e.g. "
    "torch.distributed.pipelining for pipeline-parallel jobs).",
)
@click.option(
    "--warm-fill",
    type=click.Choice(env.WARM_FILLS),
    default=env.WARM_FILLS[0],
    envvar=env.WARM_FILL,
    show_default=True,
    show_envvar=True,
    help="eager: fill the warm processes when the agent starts and right after each "
    "is taken, so that a job's first generation and a failure seconds into any "
    "starts warm; lazy: only once ranks have started here and run for "
    "--warm-refill-delay-s (a job's first generation starts cold; for small "
    "machines, where a refill beside a starting generation slows it).",
)
@click.option(
    "--warm-refill-delay-s",
    type=float,
    default=10.0,
    show_default=True,
    help="With --warm-fill lazy: fill the warm processes this long after ranks last "
    "started here (a refill costs what a cold start does; a generation that ends "
    "sooner is not charged for one).",
)
@click.option(
    "--restart-in-place/--no-restart-in-place",
    default=True,
    show_default=True,
    help="Let ranks that can (trainer.runtime, e.g. the reference trainer) leave a "
    "failed or stopped generation alive and become the same rank of the next "
    "one on the same slot, instead of starting new processes; a job can still "
    "ask for fresh processes (JobSpec cold_start).",
)
@click.option(
    "--memory-budget-gb",
    type=float,
    default=0.0,
    show_default=True,
    help="Hold this much memory (GiB, in --memory-dir) for the snapshots of the job "
    "running here, so that its ranks snapshot their state every "
    "--memory-checkpoint-every steps and a restart restores the newest one instead of an "
    "older durable checkpoint (a job whose two snapshots do not fit takes none). "
    "0: no memory tier.",
)
@click.option(
    "--memory-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where that memory is held: a tmpfs (default: a directory of this agent's "
    "own under /dev/shm). A job's is released when it ends here or another job starts.",
)
@click.option(
    "--peer-listen",
    default=":0",
    show_default=True,
    metavar="[HOST]:PORT",
    help="With --memory-budget-gb: where other agents reach this one to send it the "
    "copies of their nodes' memory snapshots and to fetch the copies it holds (a bare "
    ":PORT binds --host; port 0 picks a free one, told to the controller). Mutual TLS "
    "with the agent's certificate when it has one.",
)
@click.option(
    "--replication-mbps",
    type=float,
    default=8000.0,
    show_default=True,
    help="Each committed memory snapshot of this node is copied to a partner node, "
    "chosen by the controller outside this node's --failure-domain, at most this many "
    "megabits per second (0: no bound); a newer snapshot waits for the copy in flight "
    "and replaces any other waiting.",
)
@click.option(
    "--failure-domain",
    default="",
    metavar="NAME",
    help="What this node fails with (a rack, a power feed): its memory snapshots are "
    "copied to a node of another domain where there is one. Default: not said.",
)
@click.option(
    "--rank-user",
    default=None,
    metavar="USER",
    help="Run ranks (and warm processes) as this user and its group, not the "
    "agent's: they get their rank directories and the agent's socket, and cannot "
    "read the agent's credentials, run directory or environment. Needs root; the "
    "agent refuses to start while USER can read one of its key or token files. "
    "Default: ranks run as the agent's user.",
)
@click.option(
    "--bootstrap-address",
    "bootstrap_addresses",
    multiple=True,
    metavar="HOST:PORT",
    help="Repeatable (or comma-separated): a controller's --bootstrap-port. With it "
    "the agent needs only the CA (--tls-dir's ca.pem, or --ca) and the join token: it "
    "makes its node's key, is signed a certificate bound to this node, and renews it "
    "before it expires. Not with --cert/--key.",
)
@click.option(
    "--cert-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="With --bootstrap-address: where the node's key (agent-NODE.key, 0600) and "
    "certificate are kept across restarts (default: RUN_DIR/identity).",
)
@flags.tls_options(
    "agent",
    "ca.pem, agent-NODE.pem (else agent.pem) and key, and join.token",
    ca_help="CA certificate of the controller",
)
@flags.etcd_options
@flags.log_options
def main(
    node,
    slots,
    etcd_endpoints,
    token_file,
    run_dir,
    host,
    rendezvous_ports,
    controller,
    lease_ttl_s,
    drain_timeout_s,
    bootstrap_addresses,
    cert_dir,
    stop_grace_s,
    metrics_listen,
    metrics_address_file,
    accelerator,
    warm_processes,
    warm_imports,
    warm_fill,
    warm_refill_delay_s,
    restart_in_place,
    memory_budget_gb,
    memory_dir,
    peer_listen,
    replication_mbps,
    failure_domain,
    rank_user,
    log_format,
    log_level,
    **security,
):
    """Run a Keel node agent: register with etcd, connect to the controller, and
    supervise the rank processes it is told to run."""
    renewer = None
    try:
        endpoints = tuple(e.strip() for e in etcd_endpoints.split(",") if e.strip())
        addresses = [a.strip() for given in bootstrap_addresses for a in given.split(",")]
        addresses = [a for a in addresses if a]
        if addresses:
            configure("agent", fmt=log_format, level=log_level, node=node)
            identity, token = _identity(
                node, token_file, cert_dir or Path(run_dir) / "identity", security
            )
            try:
                files = bootstrap(addresses, identity, token)
            except CertificateRefused as exc:
                raise click.ClickException(
                    f"node {node}'s certificate request was refused: {exc}"
                ) from None
            security = {
                **security,
                "ca": str(files.ca),
                "cert": str(files.cert),
                "key": str(files.key),
            }
            renewer = Renewer(addresses, identity, token)
        config = AgentConfig(
            **security_settings(node, token_file, **security),
            node=node,
            slots=slots,
            etcd_endpoints=endpoints,
            run_dir=Path(run_dir).resolve(),
            host=net.advertised(host, endpoints, "--host") if endpoints else host,
            rendezvous_ports=net.port_range(rendezvous_ports) if rendezvous_ports else None,
            controller=controller,
            lease_ttl_s=lease_ttl_s,
            stop_grace_s=stop_grace_s,
            drain_timeout_s=drain_timeout_s,
            metrics_listen=metrics_listen,
            metrics_address_file=Path(metrics_address_file) if metrics_address_file else None,
            accelerator=accelerator,
            warm_processes=warm_processes,
            warm_fill=warm_fill,
            warm_refill_delay_s=warm_refill_delay_s,
            restart_in_place=restart_in_place,
            warm_imports=tuple(m.strip() for m in warm_imports.split(",") if m.strip()),
            rank_user=RankUser.lookup(rank_user) if rank_user else None,
            memory_budget_bytes=int(memory_budget_gb * 2**30),
            memory_dir=Path(memory_dir).resolve() if memory_dir else None,
            peer_listen=peer_listen,
            replication_mbps=replication_mbps,
            failure_domain=failure_domain,
        )
        configure("agent", fmt=log_format, level=log_level, node=node)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if renewer is not None:
        renewer.start()
    try:
        run(config)
    except (RunDirInUse, RankUserRefused) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if renewer is not None:
            renewer.stop()


def _identity(node: str, token_file, cert_dir, security: dict) -> tuple[Identity, str]:
    """The node's identity for --bootstrap-address, and the join token it asks with."""
    if security.get("cert") or security.get("key"):
        raise ValueError(
            "--bootstrap-address makes the node's own key and certificate: give "
            "--cert/--key or --bootstrap-address, not both"
        )
    tls_dir = security.get("tls_dir")
    ca = security.get("ca") or (Path(tls_dir) / "ca.pem" if tls_dir else None)
    if ca is None or not Path(ca).is_file():
        raise ValueError(
            "--bootstrap-address needs the cluster's CA certificate: --tls-dir holding "
            "ca.pem, or --ca"
        )
    token = read_token(token_file, Path(tls_dir) / "join.token" if tls_dir else None)
    if not token:
        raise ValueError(
            "--bootstrap-address needs the join token: --token-file, --tls-dir's "
            "join.token, or KEEL_TOKEN"
        )
    return Identity(Path(cert_dir).resolve(), node, Path(ca)), token


if __name__ == "__main__":
    # `keel agent` execs into this module and says so, for usage lines and errors.
    main(prog_name=os.environ.pop(env.AGENT_PROG, "python -m agent"))
