"""``keel up``: a whole local cluster on this machine, running one job to its end.

Starts etcd (embedded unless endpoints are given), the controllers and the agents as
separate processes (``cluster``), submits the job (``options``), shows its progress
and fires the injected cluster faults (``firing``) until it ends, shuts everything
down in order (agents, which stop their ranks; the controllers; etcd) and prints a
summary (``summary``).
"""

from __future__ import annotations

import getpass
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from common.etcd import etcd_flags
from common.wire_kinds import FaultKind
from orchestrator.cli.client import ControllerClient, NoController
from orchestrator.local import rank_user
from orchestrator.local.cluster import LocalCluster
from orchestrator.local.faults import kind_of
from orchestrator.local.firing import ClusterFaults
from orchestrator.local.lineage import checkpoint_home
from orchestrator.local.options import UpOptions, job_spec
from orchestrator.local.summary import Progress, print_summary, succeeded, summarize
from orchestrator.policy.lifecycle import WIRE_STATES
from protos import keel_pb2

POLL_S = 0.5
# Faults that strike the leading controller: what follows them is a failover, timed.
LEADER_FAULTS = (FaultKind.KILL_LEADER, FaultKind.STALL_LEADER, FaultKind.TERM_LEADER)


def wait_for_agents(
    client: ControllerClient, count: int, workdir: Path, timeout_s: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
        if sum(1 for n in nodes if n.connected) >= count:
            return
        time.sleep(0.1)
    raise RuntimeError(
        f"only {sum(1 for n in nodes if n.connected)}/{count} agents joined "
        f"within {timeout_s:.0f} s; see {workdir / 'logs'}"
    )


def up(options: UpOptions) -> int:
    started = time.monotonic()
    workdir = (options.workdir or Path(tempfile.mkdtemp(prefix="keel-up-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoints, moved = checkpoint_home(workdir / "checkpoints", options.resume_from, False)
    spec = job_spec(options, checkpoints)  # validates --inject before any start
    if options.rank_user:
        rank_user.prepare(options.rank_user, workdir, checkpoints, options.script)
    faults = ClusterFaults.of(spec)
    cluster = LocalCluster(
        options,
        workdir,
        proxied=any(kind_of(f) is FaultKind.PARTITION_NODE for f in faults.pending),
    )
    status, error, leader_changes, ended = None, "", 0, None
    failovers_s: list[float] = []  # from killing or stalling a leader to its successor answering
    struck_at = None
    stop = []
    previous = {
        sig: signal.signal(sig, lambda *_: stop.append(1))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    progress = Progress()
    if moved:
        progress.note(moved)
    if not options.rank_user:
        progress.note(rank_user.notice(os.geteuid(), getpass.getuser(), workdir))
    try:
        cluster.start()
        client = ControllerClient(
            cluster.token,
            etcd_endpoints=cluster.endpoints.split(","),
            tls_files=cluster.client_tls,
            etcd_credentials=cluster.etcd_credentials,
        )
        try:
            # Every agent joins before the job is submitted, so the placement is by node
            # name and the spares are the last nodes, whatever order they started in.
            wait_for_agents(client, options.nodes + options.spares, workdir)
            scrape = cluster.write_prometheus()
            client.call("SubmitJob", keel_pb2.SubmitJobRequest(spec=spec))
            credentials = " ".join(
                [
                    *(
                        ["--tls-dir", str(workdir / "tls")]
                        if options.tls
                        else ["--token-file", str(workdir / "token")]
                    ),
                    *etcd_flags(cluster.etcd_credentials),
                ]
            )
            progress.note(
                f"job {spec.name} submitted; from another shell: keel status "
                f"--etcd-endpoints {cluster.endpoints} {credentials}"
            )
            progress.note(f"metrics: prometheus --config.file {scrape}")
            deadline = time.monotonic() + options.timeout_s

            def job_status() -> keel_pb2.JobStatus:
                """The job as the leader has it; a leader change since a leader fault
                fired is that fault's failover."""
                nonlocal leader_changes, struck_at
                status = client.call("GetJob", keel_pb2.GetJobRequest(job=spec.name))
                if len(client.leaders) - 1 > leader_changes and struck_at is not None:
                    failovers_s.append(round(time.monotonic() - struck_at, 2))
                    struck_at = None
                leader_changes = len(client.leaders) - 1
                return status

            while True:
                status = job_status()
                progress.show(status)
                cluster.refresh_targets()
                for fired in faults.fire(status.step, cluster, client.address):
                    progress.note(fired.message)
                    if fired.kind in LEADER_FAULTS:
                        struck_at = time.monotonic()
                if WIRE_STATES.from_wire(status.state).terminal:
                    break
                if stop:
                    error = "interrupted"
                    break
                if time.monotonic() > deadline:
                    error = f"timed out after {options.timeout_s:.0f} s"
                    break
                if any(
                    a.poll() is not None
                    for i, a in enumerate(cluster.agents)
                    if i not in faults.lost
                ) or any(
                    c.poll() is not None
                    for i, c in enumerate(cluster.controllers)
                    if i not in faults.killed_controllers
                ):
                    error = f"a daemon exited unexpectedly; see {workdir / 'logs'}"
                    break
                time.sleep(POLL_S)
            # A leader fault that fired as the job ended: followed to the next leader,
            # so that the summary counts the failover it caused.
            while struck_at is not None and not error and time.monotonic() < deadline:
                time.sleep(POLL_S)
                status = job_status()
            ended = time.monotonic()  # the summary's wall time is the run's, not the linger's
            if options.linger_s and not error:
                progress.note(
                    f"job ended; the cluster stays up {options.linger_s:g} s (--linger-s)"
                )
                until = time.monotonic() + options.linger_s
                while not stop and time.monotonic() < until:
                    cluster.refresh_targets()
                    time.sleep(min(POLL_S, max(0.0, until - time.monotonic())))
        finally:
            client.close()
    except (RuntimeError, NoController, grpc.RpcError) as exc:
        error = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
    finally:
        progress.done()
        faults.release(cluster)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = summarize(status, (ended or time.monotonic()) - started, workdir, error)
    summary["leader_changes"] = leader_changes
    summary["failovers_s"] = failovers_s
    print_summary(summary, options.json)
    if succeeded(summary) and not error:
        return 0
    if not options.json:
        print(f"keel up failed: {error or summary['reason']}", file=sys.stderr)
    return 1
