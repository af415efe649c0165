"""``keel run``: torchrun's command line on Keel.

``keel run --nnodes 2 --nproc-per-node 4 train.py ARGS`` runs ``python -u train.py
ARGS`` as 8 ranks, with torchrun's environment, restarts after failures
(``--max-restarts``), and every rank's output on this terminal. Without
``--etcd-endpoints`` it starts a local cluster for the run (an embedded etcd, a
controller, one agent per node, as ``keel up`` does) and stops it at the end; with
them, it submits the job to that cluster and follows it. Either way it exits 0 when the
job succeeded and 1 when it failed or was stopped, as torchrun does.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import grpc

from common import flags
from common import logs as log_settings
from orchestrator.cli.client import ControllerClient, NoController
from orchestrator.cli.logs import RankOutput
from orchestrator.cli.operator import Client, connection_options
from orchestrator.local.summary import Progress
from orchestrator.policy.lifecycle import WIRE_STATES
from orchestrator.spec.jobspec import InvalidSpec, validate
from protos import keel_pb2

POLL_S = 0.5
# How long an interrupted run waits for its job to stop before it gives up on it.
STOP_WAIT_S = 60.0
# torchrun options that set up a rendezvous per node: under Keel the controller places
# every node's ranks and gives them their rendezvous, from this one command.
RENDEZVOUS_FLAGS = (
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-conf",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--local-addr",
)


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``."""
    low, _, high = value.partition(":")
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes {value!r}: give N or MIN:MAX, e.g. 2 or 1:4") from None
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes {value!r}: need 1 <= MIN <= MAX")
    return low, high


def default_job_name(target: str) -> str:
    """``run-<script or module>-<6 hex>``, within the job-name rule."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(target).stem.lower()).strip("-")[:40] or "job"
    return f"run-{stem}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RunOptions:
    target: str  # script, module or command
    args: tuple[str, ...] = ()
    module: bool = False  # -m: run TARGET as a module
    no_python: bool = False  # TARGET is the command itself
    min_nodes: int = 0  # 0: max_nodes (never shrink)
    max_nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 0
    job: str = ""
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    working_dir: str = ""  # default: this directory
    checkpoint_dir: str = ""
    resume_from: str = ""
    hang_floor_s: float = 30.0
    first_step_timeout_s: float = 0.0
    cold_start: bool = False  # never from the agents' warm processes

    def __post_init__(self):
        if self.nproc_per_node < 1:
            raise ValueError("--nproc-per-node must be at least 1")
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must be 0 or more")
        if self.module and self.no_python:
            raise ValueError(
                "-m and --no-python exclude each other: --no-python runs "
                "TARGET as a program, -m as a Python module"
            )

    @property
    def world_size(self) -> int:
        return self.max_nodes * self.nproc_per_node

    def spec(self) -> keel_pb2.JobSpec:
        """The job; raises InvalidSpec naming what to fix."""
        command = (
            [self.target, *self.args]
            if self.no_python
            else [self.python, "-u", *(["-m"] if self.module else []), self.target, *self.args]
        )
        spec = keel_pb2.JobSpec(
            name=self.job,
            world_size=self.world_size,
            command=command,
            env=self.env,
            max_restarts=self.max_restarts,
            ranks_per_node=self.nproc_per_node,
            # --nnodes N never shrinks, as under torchrun; MIN:MAX may, down to MIN.
            min_nodes=self.min_nodes if 0 < self.min_nodes < self.max_nodes else 0,
            mesh=f"dp_shard={self.world_size}",
            working_dir=os.path.abspath(self.working_dir or os.getcwd()),
            checkpoint_dir=os.path.abspath(self.checkpoint_dir) if self.checkpoint_dir else "",
            resume_from=os.path.abspath(self.resume_from) if self.resume_from else "",
            cold_start=self.cold_start,
        )
        spec.health.CopyFrom(
            keel_pb2.HealthSpec(
                hang_floor_s=self.hang_floor_s,
                first_step_timeout_s=self.first_step_timeout_s or max(self.hang_floor_s, 120.0),
            )
        )
        validate(spec)
        return spec


class Follow:
    """Follows a submitted job to its end: Keel's own lines (state, failures,
    events) on stderr, the ranks' output on stdout and stderr."""

    def __init__(self, client: ControllerClient, job: str, stream: bool, prefix: bool):
        self.client = client
        self.job = job
        self.progress = Progress()
        self.output = RankOutput(client.call, job, prefix=prefix) if stream else None
        self.unreadable: set[tuple[int, int]] = set()  # said once, then skipped
        self.generation = 0
        self.world_size = 0

    def status(self) -> keel_pb2.JobStatus:
        return self.client.call("GetJob", keel_pb2.GetJobRequest(job=self.job))

    def tick(self) -> keel_pb2.JobStatus:
        status = self.status()
        if status.generation != self.generation:
            self._drain()
            self.generation, self.world_size = status.generation, status.world_size
        self.progress.show(status)
        self._pull()
        return status

    def _pull(self) -> None:
        if self.output is None or not self.generation:
            return
        for rank in range(self.world_size):
            key = (self.generation, rank)
            if key in self.unreadable:
                continue
            try:
                self.output.pull(*key)
            except grpc.RpcError as err:
                if err.code() is grpc.StatusCode.NOT_FOUND:
                    continue  # its rank has not started (written nothing) yet
                self.unreadable.add(key)
                self.progress.note(f"rank {rank}'s output: {err.details()}")

    def _drain(self) -> None:
        """The last of the ending generation's output, every unfinished line too."""
        if self.output is None or not self.generation:
            return
        self._pull()
        for rank in range(self.world_size):
            self.output.finish(self.generation, rank)

    def done(self) -> None:
        self._drain()
        self.progress.done()


def follow(
    client: ControllerClient,
    job: str,
    stream: bool,
    prefix: bool,
    timeout_s: float,
    alive=lambda: "",
) -> tuple[keel_pb2.JobStatus | None, str]:
    """Follow ``job`` until it ends; (its last status, why following stopped early or "").
    SIGINT or SIGTERM stops the job (no final checkpoint) and waits for it to end; a
    second one leaves at once. ``alive`` says what went wrong with the cluster, if
    anything (a local cluster's daemon exited)."""
    tracker = Follow(client, job, stream, prefix)
    interrupts = []
    previous = {
        sig: signal.signal(sig, lambda *_: interrupts.append(1))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    status, error, stop_sent = None, "", False
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            status = tracker.tick()
            if WIRE_STATES.from_wire(status.state).terminal:
                break
            if interrupts and not stop_sent:
                tracker.progress.note(
                    f"interrupted: stopping job {job} (again to leave without waiting)"
                )
                client.call(
                    "StopJob",
                    keel_pb2.StopJobRequest(job=job, now=True, reason="keel run was interrupted"),
                )
                stop_sent, deadline = True, time.monotonic() + STOP_WAIT_S
                error = "interrupted"
            elif len(interrupts) > 1:
                break
            if time.monotonic() > deadline:
                error = error or f"timed out after {timeout_s:.0f} s"
                break
            problem = alive()
            if problem:
                error = problem
                break
            time.sleep(POLL_S)
    finally:
        tracker.done()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status, error


def outcome(status: keel_pb2.JobStatus | None, error: str) -> int:
    """torchrun's exit status: 0 when every rank succeeded, else 1 (the reason on
    stderr)."""
    if status is not None and status.state == keel_pb2.JOB_STATE_SUCCEEDED and not error:
        click.echo(
            f"keel run: job {status.job} succeeded in {status.generation} "
            f"generation(s), {status.restarts} restart(s)",
            err=True,
        )
        return 0
    reason = error or (
        f"{WIRE_STATES.text(status.state)}: {status.reason}" if status else "not started"
    )
    if status is not None:
        for failure in status.failures:
            click.echo(
                f"keel run: generation {failure.generation}: rank {failure.rank} on "
                f"{failure.node} "
                + (
                    f"killed by signal {failure.signal}"
                    if failure.signal
                    else f"exited {failure.exit_code}"
                ),
                err=True,
            )
    click.echo(f"keel run: job {status.job if status else ''} failed: {reason}", err=True)
    return 1


def run_local(
    options: RunOptions,
    spec: keel_pb2.JobSpec,
    workdir: Path | None,
    stream: bool,
    timeout_s: float,
    log_format: str,
    log_level: str,
) -> int:
    """On a cluster of this machine's own, started for the run and stopped after it."""
    from orchestrator.local.cluster import LocalCluster
    from orchestrator.local.lineage import checkpoint_home
    from orchestrator.local.options import UpOptions
    from orchestrator.local.up import wait_for_agents

    workdir = (workdir or Path(tempfile.mkdtemp(prefix="keel-run-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    home, moved = checkpoint_home(
        Path(spec.checkpoint_dir or workdir / "checkpoints"),
        spec.resume_from,
        chosen=bool(spec.checkpoint_dir),
    )
    spec.checkpoint_dir = str(home)
    validate(spec)
    if moved:
        click.echo(f"keel run: {moved}", err=True)
    cluster = LocalCluster(
        UpOptions(
            nodes=options.max_nodes,
            slots_per_node=options.nproc_per_node,
            max_restarts=options.max_restarts,
            workdir=workdir,
            log_format=log_format,
            log_level=log_level,
        ),
        workdir,
    )
    status, error = None, ""
    try:
        cluster.start()
        client = ControllerClient(cluster.token, etcd_endpoints=cluster.endpoints.split(","))
        try:
            wait_for_agents(client, options.max_nodes, workdir)
            client.call("SubmitJob", keel_pb2.SubmitJobRequest(spec=spec))
            click.echo(
                f"keel run: job {spec.name}, {spec.world_size} rank(s) on "
                f"{options.max_nodes} local node(s); logs in {workdir}",
                err=True,
            )

            def alive() -> str:
                if any(p.poll() is not None for p in [*cluster.agents, *cluster.controllers]):
                    return f"a daemon of the local cluster exited; see {workdir / 'logs'}"
                return ""

            status, error = follow(
                client, spec.name, stream, options.world_size > 1, timeout_s, alive
            )
        finally:
            client.close()
    except (RuntimeError, NoController) as exc:
        error = str(exc)
    except grpc.RpcError as exc:
        error = exc.details()
    except KeyboardInterrupt:  # before the job was being followed
        error = "interrupted"
    finally:
        cluster.stop()
    return outcome(status, error)


def run_remote(
    spec: keel_pb2.JobSpec, client: Client, stream: bool, detach: bool, timeout_s: float
) -> int:
    """On the cluster ``client`` reaches: submit, then follow (unless ``detach``)."""
    client.call("SubmitJob", keel_pb2.SubmitJobRequest(spec=spec))
    click.echo(
        f"keel run: job {spec.name} submitted, {spec.world_size} rank(s) of "
        f"{spec.ranks_per_node} per node; `keel logs {spec.name} --rank R -f` "
        f"shows a rank's output",
        err=True,
    )
    if detach:
        click.echo(spec.name)
        return 0
    try:
        status, error = follow(client.client, spec.name, stream, spec.world_size > 1, timeout_s)
    except (grpc.RpcError, NoController) as exc:
        raise click.ClickException(
            f"lost the controller while following job {spec.name} "
            f"(it runs on; `keel status` shows it): {exc}"
        ) from None
    return outcome(status, error)


def _env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--env {pair!r}: write NAME=VALUE")
        out[name] = value
    return out


def _torchrun_names(*names: str) -> list[str]:
    """An option's dashed name and torchrun's underscored alias (--nproc_per_node)."""
    return [*names, *("--" + n[2:].replace("-", "_") for n in names if "-" in n[2:])]


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "allow_interspersed_args": False}
)
@click.option(
    *_torchrun_names("--nnodes"),
    default="1",
    show_default=True,
    metavar="N|MIN:MAX",
    help="Nodes, each running --nproc-per-node ranks. MIN:MAX starts on MAX and "
    "may go on with as few as MIN after losing nodes (the world size "
    "shrinks with them).",
)
@click.option(
    *_torchrun_names("--nproc-per-node"),
    "nproc_per_node",
    type=int,
    default=1,
    show_default=True,
    help="Ranks per node.",
)
@click.option(
    *_torchrun_names("--max-restarts"),
    "max_restarts",
    type=int,
    default=0,
    show_default=True,
    help="Restarts after failures before the job fails.",
)
@click.option(
    "-m", "--module", is_flag=True, help="Run TARGET as a Python module (python -m TARGET)."
)
@click.option(
    *_torchrun_names("--no-python"),
    "no_python",
    is_flag=True,
    help="Run TARGET as a program, not as a Python script.",
)
@click.option(
    "--standalone",
    is_flag=True,
    help="Accepted for torchrun's sake: a local cluster is the default anyway.",
)
@click.option(
    *_torchrun_names("--rdzv-id", "--run-id"),
    "job_name",
    default=None,
    help="The job's name (default: run-<target>-<6 hex>).",
)
@click.option(
    *[n for flag in RENDEZVOUS_FLAGS for n in _torchrun_names(flag)],
    "rendezvous_flag",
    default=None,
    hidden=True,
    expose_value=True,
)
@click.option(
    "--env",
    "env_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Set in every rank's environment; repeatable. Local ranks inherit this "
    "shell's environment; remote ranks get their agent's, plus these.",
)
@click.option(
    "--python",
    default=sys.executable,
    show_default=True,
    help="Interpreter the ranks run (it must exist on every node).",
)
@click.option(
    "--checkpoint-dir",
    default="",
    help="KEEL_CHECKPOINT_DIR of the ranks (default: WORKDIR/checkpoints locally, "
    "none on a cluster).",
)
@click.option(
    "--resume-from",
    default="",
    metavar="PATH",
    help="KEEL_RESUME_FROM of the ranks: start a new lineage from this checkpoint or "
    "checkpoint directory (read, never changed) until the job records its own. Locally, "
    "a default WORKDIR/checkpoints holding another lineage's becomes WORKDIR/checkpoints-N.",
)
@flags.hang_options
@click.option(
    "--cold-start",
    is_flag=True,
    help="Start every rank as a fresh process, not from the agents' warm ones "
    "(torch imported ahead of time).",
)
@click.option("--quiet", is_flag=True, help="Do not copy the ranks' output here.")
@click.option(
    "--detach", is_flag=True, help="With --etcd-endpoints: submit, print the job's name and exit."
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="Local cluster only: its logs, the ranks' output and checkpoints (default: "
    "a new temporary directory, kept).",
)
@click.option(
    "--timeout-s",
    type=float,
    default=7 * 24 * 3600.0,
    show_default=True,
    help="Stop following (and, locally, stop the job) after this long.",
)
@connection_options(with_json=False)
@click.option(
    "--log-format",
    type=click.Choice(log_settings.FORMATS),
    default=None,
    help="Local cluster only: log format of its daemons and ranks (default json).",
)
@click.option(
    "--log-level",
    type=click.Choice(log_settings.LEVELS),
    default=None,
    help="Local cluster only: their log level (default info).",
)
@click.argument("target", metavar="TARGET")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    nnodes,
    nproc_per_node,
    max_restarts,
    module,
    no_python,
    standalone,
    job_name,
    rendezvous_flag,
    env_pairs,
    python,
    checkpoint_dir,
    resume_from,
    hang_floor_s,
    first_step_timeout_s,
    cold_start,
    quiet,
    detach,
    workdir,
    timeout_s,
    controller,
    etcd_endpoints,
    token_file,
    log_format,
    log_level,
    target,
    args,
    **security,
):
    """Run TARGET (a script, a module with -m, a program with --no-python) as torchrun
    would, under Keel: on a local cluster started for it, or on the cluster of
    --etcd-endpoints (env KEEL_ETCD_ENDPOINTS). Options go before TARGET; what follows
    it is TARGET's. Exits 0 when every rank succeeded, else 1."""
    if rendezvous_flag is not None:
        raise click.UsageError(
            f"{'/'.join(RENDEZVOUS_FLAGS)}: keel run starts every node's ranks from this "
            f"one command and Keel gives them their rendezvous; run it once, without them"
        )
    remote = bool(etcd_endpoints or controller)
    if standalone and remote:
        raise click.UsageError(
            "--standalone runs a local cluster; drop it or --etcd-endpoints/--controller"
        )
    if not remote and (detach or any(security.values()) or token_file):
        raise click.UsageError(
            "--detach, --token-file and the TLS options are for a cluster "
            "given with --etcd-endpoints; a local run needs none"
        )
    if remote and workdir:
        raise click.UsageError(
            "--workdir is the local cluster's; on a cluster each agent's "
            "--run-dir holds the ranks' output"
        )
    try:
        low, high = parse_nnodes(nnodes)
        if not no_python and not module and not remote and not Path(target).is_file():
            raise ValueError(
                f"{target}: no such script (give -m for a module, --no-python for a program)"
            )
        options = RunOptions(
            target=target,
            args=tuple(args),
            module=module,
            no_python=no_python,
            min_nodes=low,
            max_nodes=high,
            nproc_per_node=nproc_per_node,
            max_restarts=max_restarts,
            job=job_name or default_job_name(target),
            env=_env_pairs(env_pairs),
            python=python,
            checkpoint_dir=checkpoint_dir,
            resume_from=resume_from,
            hang_floor_s=hang_floor_s,
            first_step_timeout_s=first_step_timeout_s,
            cold_start=cold_start,
        )
        spec = options.spec()
        log_format, log_level = log_settings.settings(log_format, log_level, tty=False)
    except (ValueError, InvalidSpec) as exc:
        raise click.UsageError(str(exc)) from exc
    if remote:
        client = Client(controller, etcd_endpoints, token_file, **security)
        sys.exit(run_remote(spec, client, not quiet, detach, timeout_s))
    from orchestrator.local.etcd_server import EtcdMissing, etcd_binary

    try:
        etcd_binary()
    except EtcdMissing as exc:
        raise click.ClickException(str(exc)) from None
    try:
        code = run_local(
            options,
            spec,
            Path(workdir) if workdir else None,
            not quiet,
            timeout_s,
            log_format,
            log_level,
        )
    except (ValueError, InvalidSpec) as exc:  # its checkpoint directory: nothing started
        raise click.UsageError(str(exc)) from exc
    sys.exit(code)
