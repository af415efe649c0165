"""The ``keel`` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from common import env, flags, logs, net
from common.etcd import etcd_credentials
from common.net import listen_address
from orchestrator.security import tls

CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=CONTEXT)
def main():
    """Keel: fault-tolerant training orchestration on torch.distributed."""


@main.command(context_settings=CONTEXT)
@click.option(
    "--nodes",
    type=int,
    default=2,
    show_default=True,
    help="Agents (simulated nodes) to start on this machine.",
)
@click.option(
    "--slots-per-node",
    type=int,
    default=2,
    show_default=True,
    help="Rank processes per node; the job runs on nodes × slots ranks.",
)
@click.option(
    "--steps", type=int, default=40, show_default=True, help="Step target of the reference trainer."
)
@click.option(
    "--checkpoint-every",
    type=int,
    default=10,
    show_default=True,
    help="Reference trainer: commit a checkpoint every this many steps.",
)
@click.option(
    "--resume-from",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Start a new lineage from this checkpoint (a committed step_N) or checkpoint "
    "directory (its newest verifiable one), of any run, world size or layout; it is "
    "read, never changed. If WORKDIR/checkpoints holds another lineage's, this run "
    "writes in WORKDIR/checkpoints-N.",
)
@click.option(
    "--script",
    type=click.Path(exists=True, dir_okay=False),
    help="Run this torchrun-style script instead of the reference trainer "
    "(or use `keel run`). Arguments after `--` go to the script, or without "
    "--script to the reference trainer (e.g. -- --dim 128 --lr 1e-3; see "
    "python -m trainer.train --help).",
)
@click.option(
    "--inject",
    multiple=True,
    metavar="FAULT",
    help="Deterministic fault, repeatable: crash:rank=R,step=N | "
    "crash:node=I,step=N (node I's ranks crash in every generation there) | "
    "kill:rank=R,step=N | hang:rank=R,step=N | slow:rank=R,step=N,factor=F | "
    "lose_node:node=I,step=N (node I's agent and ranks killed at once) | "
    "kill_leader:step=N (the leading controller SIGKILLed) | "
    "restart_etcd:step=N[,down=S] (etcd SIGKILLed, back S s later on its data; "
    "default 2) | "
    "kill_agent:node=I,step=N (node I's agent SIGKILLed, then started "
    "again) | term_agent:node=I,step=N (node I's agent sent SIGTERM: it "
    "drains its node and exits) | term_leader:step=N (the leader sent "
    "SIGTERM: it hands the lead over) | "
    "stall_leader:step=N,for=S (the leader SIGSTOPped for S s) | "
    "stall_agent:node=I,step=N,for=S (node I's agent alone SIGSTOPped) | "
    "stall_node:node=I,step=N,for=S (the agent and every process under it) | "
    "partition_node:node=I,step=N,for=S (node I cut from etcd and the "
    "controllers by its TCP proxy while it runs on).",
)
@click.option(
    "--layout",
    default=None,
    metavar="LAYOUT",
    help="Parallel layout, e.g. dp_shard=2,tp=2 (axes dp_replicate, dp_shard, tp, "
    "pp; omitted ones are 1), or 'auto' for the planner's choice. Default: "
    "dp_shard over every rank.",
)
@click.option(
    "--min-nodes",
    type=int,
    default=1,
    show_default=True,
    help="After losing nodes with no spare, re-plan onto as few as this many "
    "(0: never shrink, wait for capacity).",
)
@click.option(
    "--controllers",
    type=int,
    default=1,
    show_default=True,
    help="Controllers to run; beyond the first they wait as standbys and take "
    "over (without restarting the job) if the leader dies.",
)
@click.option(
    "--spares",
    type=int,
    default=0,
    show_default=True,
    help="Extra agents that wait as hot spares for failed or slow nodes.",
)
@click.option(
    "--straggler-policy",
    type=click.Choice(["replace", "exclude", "alert"]),
    default="replace",
    show_default=True,
    help="What to do with a persistently slow node: checkpoint and swap in a "
    "spare, checkpoint and re-plan without it, or only report it.",
)
@flags.hang_options
@click.option(
    "--collective-timeout-s",
    type=float,
    default=0.0,
    help="The ranks' collective timeout, also how long a rank runs on when its "
    "agent stops answering before it stops itself (default: 60 s, or more "
    "to fit --hang-floor-s; at least 1.2 x (floor + the 5 s stop grace)).",
)
@click.option(
    "--no-preflight",
    is_flag=True,
    help="Skip the collective bandwidth sweep before each generation's first step.",
)
@click.option(
    "--max-restarts",
    type=int,
    default=3,
    show_default=True,
    help="Generations restarted after failures before the job fails.",
)
@click.option(
    "--etcd-endpoints",
    default="",
    envvar=env.ETCD_ENDPOINTS,
    show_envvar=True,
    help="Use this etcd cluster (host:port,...) instead of an embedded one.",
)
@click.option(
    "--etcd-members",
    type=click.Choice(["1", "3", "5"]),
    default="1",
    show_default=True,
    help="Members of the embedded etcd, each its own process on its own ports, as a "
    "production etcd runs (a majority must be up).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="Logs and checkpoints go here (default: a new temporary directory, kept).",
)
@click.option(
    "--timeout-s",
    type=float,
    default=3600,
    show_default=True,
    help="Give up (non-zero exit) if the job has not ended by then.",
)
@click.option(
    "--linger-s",
    type=float,
    default=0,
    show_default=True,
    help="Keep the cluster up this many seconds after the job ends, so that a Prometheus "
    "or dashboard watching it sees the job's end state (Ctrl-C ends it sooner).",
)
@flags.etcd_options
@click.option(
    "--tls",
    "use_tls",
    is_flag=True,
    help="Mutual TLS and role tokens: `keel certs init` into WORKDIR/tls (reused "
    "if there), agents given the join token, keel up the operator's.",
)
@click.option(
    "--memory-budget-gb",
    type=float,
    default=0.0,
    show_default=True,
    help="Each agent holds this much memory (GiB, under /dev/shm) for the job's "
    "snapshots: the reference trainer snapshots every step there, each is copied to a "
    "partner node, and a restart restores the newest snapshot (on a replacement node, "
    "its partner's copy) instead of an older checkpoint (keel agent --memory-budget-gb). "
    "The simulated nodes' memory is one /dev/shm/keel-up-* "
    "directory, removed when keel up stops (or by the next keel up, if this one was "
    "killed). 0: no memory tier.",
)
@click.option(
    "--replication-mbps",
    type=float,
    default=None,
    help="With --memory-budget-gb: each node's snapshots are copied to a partner node "
    "at most this many megabits per second (keel agent --replication-mbps; 0: no "
    "bound). Default: the agents'.",
)
@click.option(
    "--failure-domains",
    default="",
    metavar="D0,D1,...",
    help="Each node's failure domain, in order, spares last (keel agent "
    "--failure-domain): a node's snapshot copies go to a partner in another domain "
    "where there is one. Default: none said.",
)
@click.option(
    "--warm-fill",
    type=click.Choice(env.WARM_FILLS),
    default=None,
    envvar=env.WARM_FILL,
    show_envvar=True,
    help="When the agents fill their warm processes (keel agent --warm-fill): eager "
    "(their default) at their start and right after each is taken, so the job's "
    "first generation starts warm; lazy only once ranks have run a while.",
)
@click.option(
    "--rank-user",
    default=None,
    metavar="USER",
    help="Run the job's ranks as USER (created as a system user if missing), not as "
    "keel up and its agents: they cannot read the cluster's keys, tokens or the "
    "agents' environment, and write WORKDIR's checkpoints as USER. Needs root. "
    "Without it keel up says once what its ranks can read.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout."
)
@click.option(
    "--log-format",
    type=click.Choice(logs.FORMATS),
    default=None,
    help=f"Log format of the controllers, agents and ranks started, which log "
    f"to WORKDIR/logs and WORKDIR/nodes/NODE/JOB/genG/rankR.err (default: "
    f"json; env {env.LOG_FORMAT}). keel up's own progress stays text.",
)
@click.option(
    "--log-level",
    type=click.Choice(logs.LEVELS),
    default=None,
    help=f"Their log level (default: info; env {env.LOG_LEVEL}).",
)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def up(
    nodes,
    slots_per_node,
    steps,
    checkpoint_every,
    resume_from,
    script,
    inject,
    layout,
    min_nodes,
    controllers,
    spares,
    straggler_policy,
    hang_floor_s,
    first_step_timeout_s,
    collective_timeout_s,
    no_preflight,
    max_restarts,
    etcd_endpoints,
    etcd_members,
    workdir,
    timeout_s,
    linger_s,
    use_tls,
    memory_budget_gb,
    replication_mbps,
    failure_domains,
    warm_fill,
    rank_user,
    as_json,
    log_format,
    log_level,
    script_args,
    **etcd,
):
    """Start etcd, a controller and agents here, run one job to its end, stop all.

    Progress goes to stderr; the summary to stdout. Exits 0 only if the job reached
    its step target.
    """
    from orchestrator.local.etcd_server import EtcdMissing, etcd_binary
    from orchestrator.local.options import UpOptions
    from orchestrator.local.up import up as run_up

    if not etcd_endpoints:
        try:
            etcd_binary()
        except EtcdMissing as exc:
            raise click.ClickException(str(exc)) from None

    try:
        # Their logs go to files, never a terminal: json unless asked otherwise.
        log_format, log_level = logs.settings(log_format, log_level, tty=False)
        options = UpOptions(
            nodes=nodes,
            slots_per_node=slots_per_node,
            steps=steps,
            checkpoint_every=checkpoint_every,
            resume_from=resume_from or "",
            script=script,
            script_args=tuple(script_args),
            inject=tuple(inject),
            layout=layout,
            min_nodes=min_nodes,
            spares=spares,
            controllers=controllers,
            straggler_policy=straggler_policy,
            hang_floor_s=hang_floor_s,
            first_step_timeout_s=first_step_timeout_s,
            collective_timeout_s=collective_timeout_s,
            preflight=not no_preflight,
            max_restarts=max_restarts,
            etcd_endpoints=tuple(e for e in etcd_endpoints.split(",") if e),
            etcd_members=int(etcd_members),
            workdir=Path(workdir) if workdir else None,
            timeout_s=timeout_s,
            linger_s=linger_s,
            tls=use_tls,
            rank_user=rank_user or "",
            memory_budget_gb=memory_budget_gb,
            replication_mbps=replication_mbps,
            failure_domains=tuple(d.strip() for d in failure_domains.split(",") if d.strip()),
            warm_fill=warm_fill or "",
            etcd_credentials=etcd_credentials(**etcd),
            json=as_json,
            log_format=log_format,
            log_level=log_level,
        )
        code = run_up(options)
    except ValueError as exc:  # bad options, faults or job spec: nothing was started
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:  # e.g. a --workdir that cannot be a directory
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


@main.command(context_settings=CONTEXT)
@click.option(
    "--params",
    type=float,
    default=None,
    help="Parameter count, e.g. 70e9 (or give --layers/--hidden/--heads/--vocab).",
)
@click.option("--layers", type=int, default=0, help="Transformer layers.")
@click.option("--hidden", type=int, default=0, help="Hidden size.")
@click.option("--heads", type=int, default=0, help="Attention heads.")
@click.option("--vocab", type=int, default=0, help="Vocabulary size.")
@click.option("--gpus", type=int, required=True, help="World size to lay out.")
@click.option(
    "--gpus-per-node",
    type=int,
    required=True,
    help="GPUs per node (tensor parallel stays within a node).",
)
@click.option("--gpu-memory-gb", type=float, required=True, help="Memory per GPU, GB (1e9).")
@click.option("--seq-len", type=int, default=4096, show_default=True)
@click.option(
    "--micro-batch",
    type=int,
    default=1,
    show_default=True,
    help="Samples per micro-batch per data-parallel rank.",
)
@click.option(
    "--global-batch",
    type=int,
    default=None,
    help="Samples per step; the data-parallel size must divide it.",
)
@click.option(
    "--microbatches",
    type=int,
    default=8,
    show_default=True,
    help="Pipeline micro-batches per step.",
)
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--activation-checkpointing", is_flag=True, help="Recompute activations per block.")
@click.option(
    "--pp-schedule",
    type=click.Choice(["gpipe", "1f1b", "interleaved_1f1b"]),
    default="1f1b",
    show_default=True,
)
@click.option(
    "--virtual-stages",
    type=int,
    default=2,
    show_default=True,
    help="Stages per rank for interleaved 1F1B.",
)
@click.option(
    "--headroom",
    type=float,
    default=0.15,
    show_default=True,
    help="Fraction of GPU memory kept free (0.10-0.20).",
)
@click.option("--top", type=int, default=10, show_default=True, help="Rows to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the candidates as JSON.")
def plan(
    params,
    layers,
    hidden,
    heads,
    vocab,
    gpus,
    gpus_per_node,
    gpu_memory_gb,
    seq_len,
    micro_batch,
    global_batch,
    microbatches,
    precision,
    activation_checkpointing,
    pp_schedule,
    virtual_stages,
    headroom,
    top,
    as_json,
):
    """Rank the parallel layouts for a model on a cluster, with the memory per GPU,
    communication, pipeline bubble and the reason for each."""
    import json

    from orchestrator import planner

    try:
        if params is None:
            if not (layers and hidden and heads and vocab):
                raise ValueError("give --params, or all of --layers, --hidden, --heads, --vocab")
            model = planner.ModelShape.from_dims(
                layers=layers, hidden=hidden, heads=heads, vocab=vocab
            )
        else:
            model = planner.ModelShape(
                params=params, layers=layers, hidden=hidden, heads=heads, vocab=vocab
            )
        cluster = planner.Cluster(
            world_size=gpus, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb
        )
        training = planner.Training(
            seq_len=seq_len,
            micro_batch=micro_batch,
            global_batch=global_batch,
            microbatches=microbatches,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            headroom=headroom,
            pp_schedule=pp_schedule,
            virtual_stages=virtual_stages,
        )
        found = planner.candidates(model, cluster, training)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if not found:
        raise click.ClickException("no layout is valid for this model and cluster")
    if as_json:
        click.echo(json.dumps(planner.to_json(found[:top])))
    else:
        click.echo(planner.table(found[:top]))
        if not found[0].fits:
            click.echo("no layout fits in memory; see the smallest totals above", err=True)


@main.command(context_settings=CONTEXT)
@click.option(
    "--etcd-endpoints",
    required=True,
    envvar=env.ETCD_ENDPOINTS,
    help="Comma-separated etcd host:port list (env KEEL_ETCD_ENDPOINTS).",
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the one token every client must send, valid for every "
    "role (else the role tokens, else env KEEL_TOKEN).",
)
@click.option(
    "--listen",
    default=None,
    metavar="[HOST]:PORT",
    help="Serve gRPC here; a bare :PORT binds the advertised host; port 0 picks "
    "a free one (default: the advertised host, a free port).",
)
@click.option(
    "--advertise-host",
    default=None,
    help="Host agents and operators reach this controller on (default: this "
    "machine's address on the route to etcd; a loopback one is refused when "
    "etcd is remote).",
)
@click.option(
    "--address-file",
    type=click.Path(dir_okay=False),
    help="Write the served host:port here once listening.",
)
@flags.metrics_options("--advertise-host")
@click.option(
    "--finished-job-metrics-s",
    type=float,
    default=300.0,
    show_default=True,
    help="Keep exporting an ended job's series this long.",
)
@click.option(
    "--peak-flops",
    "peak_flops",
    multiple=True,
    metavar="NAME=FLOPS",
    help="Peak FLOP/s of an accelerator whose name contains NAME, for MFU "
    "(adds to or overrides the built-in H100/H200/A100/B200/... table); "
    "repeatable.",
)
@click.option(
    "--node-lost-grace-s",
    type=float,
    default=10.0,
    show_default=True,
    help="A node whose agent stream is down this long is lost.",
)
@click.option(
    "--rendezvous-timeout-s",
    type=float,
    default=30.0,
    show_default=True,
    help="Rank 0's agent must publish a rendezvous port within this.",
)
@click.option(
    "--report-messages-per-s",
    type=float,
    default=1000.0,
    show_default=True,
    help="Step-report messages a second the agents send together, about: in a "
    "cluster past half as many agents, each is asked to batch its step "
    "reports for longer (1, 2, 4, up to 8 s).",
)
@click.option(
    "--finished-job-ttl-s",
    type=float,
    default=7 * 24 * 3600.0,
    show_default=True,
    help="Delete an ended job's records from etcd this long after it ended (0: "
    "keep them until `keel delete JOB`). Its checkpoints stay on disk.",
)
@tls.role_token_options
@tls.bootstrap_options
@flags.tls_options("controller", "ca.pem, controller.pem, controller.key and the three role tokens")
@flags.etcd_options
@flags.log_options
def controller(
    etcd_endpoints,
    token_file,
    bootstrap_port,
    ca_key,
    approve_agents,
    agent_certificate_lifetime_s,
    allow_shared_agent_certificate,
    listen,
    advertise_host,
    address_file,
    metrics_listen,
    metrics_address_file,
    finished_job_metrics_s,
    peak_flops,
    node_lost_grace_s,
    rendezvous_timeout_s,
    report_messages_per_s,
    finished_job_ttl_s,
    log_format,
    log_level,
    **security,
):
    """Run the controller daemon in the foreground.

    Serves mutual TLS when given certificates (--tls-dir, or --ca/--cert/--key), else
    plaintext. Tokens: --token-file is one token for every role; otherwise the join,
    operator and reader tokens (flags, then --tls-dir) give each client only its role's
    calls.
    """
    from common.logs import configure
    from orchestrator.controller.config import ControllerConfig
    from orchestrator.controller.daemon import run

    try:
        endpoints = tuple(e.strip() for e in etcd_endpoints.split(",") if e.strip())
        advertise_host = (
            net.advertised(advertise_host, endpoints, "--advertise-host")
            if endpoints
            else advertise_host or "127.0.0.1"
        )
        config = ControllerConfig(
            etcd_endpoints=endpoints,
            **tls.controller_settings(token_file, security),
            listen=listen_address(listen or ":0", advertise_host),
            advertise_host=advertise_host,
            address_file=Path(address_file) if address_file else None,
            metrics_listen=metrics_listen,
            metrics_address_file=Path(metrics_address_file) if metrics_address_file else None,
            finished_job_metrics_s=finished_job_metrics_s,
            peak_flops=_peak_flops(peak_flops),
            node_lost_grace_s=node_lost_grace_s,
            rendezvous_timeout_s=rendezvous_timeout_s,
            finished_job_ttl_s=finished_job_ttl_s,
            report_messages_per_s=report_messages_per_s,
            **tls.bootstrap_settings(
                security.get("tls_dir"),
                bootstrap_port,
                ca_key,
                approve_agents,
                agent_certificate_lifetime_s,
                allow_shared_agent_certificate,
            ),
        )
        configure("controller", fmt=log_format, level=log_level)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    run(config)


def _peak_flops(pairs: tuple[str, ...]) -> dict[str, float]:
    """``NAME=FLOPS`` pairs, e.g. ``H100=989e12``."""
    peaks = {}
    for pair in pairs:
        name, _, flops = pair.partition("=")
        try:
            peaks[name.strip()] = float(flops)
        except ValueError:
            raise ValueError(f"--peak-flops {pair!r}: write NAME=FLOPS, e.g. H100=989e12") from None
    return peaks


@main.command(
    context_settings={
        **CONTEXT,
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],
    }
)
@click.pass_context
def agent(ctx):
    """Run a node agent (same as `python -m agent`; `keel agent --help` for options)."""
    # The agent lives in its own package that the controller never imports; hand over.
    os.execve(
        sys.executable,
        [sys.executable, "-m", "agent", *ctx.args],
        {**os.environ, env.AGENT_PROG: "keel agent"},
    )


def _register_operator_commands() -> None:
    from orchestrator.cli import operator as operator_cli
    from orchestrator.cli.logs import logs
    from orchestrator.cli.restore_epoch import restore_epoch
    from orchestrator.cli.run import run
    from orchestrator.security.certs import certs
    from orchestrator.security.etcd_setup import etcd

    for command in (
        run,
        logs,
        operator_cli.status,
        operator_cli.nodes,
        operator_cli.jobs,
        operator_cli.events,
        *operator_cli.MUTATING,
        restore_epoch,
        certs,
        etcd,
    ):
        main.add_command(command)
    for command in operator_cli.CERTS:
        certs.add_command(command)


_register_operator_commands()
