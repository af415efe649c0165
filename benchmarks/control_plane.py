"""The controller under thousands of agents: what it costs, whether it keeps leading,
and how fast a cluster comes back to a new leader.

For each size, from scratch: a fresh etcd (``orchestrator.local.etcd_server``), a leading
controller and a standby (``keel controller``, real processes), a job of 8 ranks per
node across every node (submitted first: it starts once all are connected), and the
simulated agents (``benchmarks/simulated_agents.py``: real gRPC streams, each on its
own TCP connection, each agent with its own etcd lease; many agents per process on one
event loop; each reports its 8 ranks' steps once a second, and its status when it
changes and, unchanged, every 10 s or 10 step batches, as the real agent does).
Measured:

* ``connect``: from the load generator's start to every agent connected to the leader
  (a connect storm: all start at once), and to the job RUNNING;
* over a steady window of ``--duration`` seconds with the job running: the leader's
  CPU (of one core), RSS and threads; operator calls (``ListNodes``, ``GetJob``,
  ``ListJobs`` in turn, 4 a second) p50/p99; etcd writes (puts and deletes) per second;
  step-downs (``stepped down`` in the controllers' logs); the load generator's
  and etcd's CPU, which share the machine's cores (the generator runs under
  ``SCHED_IDLE``: on a cluster the agents are other machines); and ``delivered``, the
  tokens the leader counted over the window against what the agents should report
  (nodes x 8 ranks x 4,096 a second), which says whether the generator kept up;
* a failover: the leader is SIGKILLed; the time until every agent is connected to the
  standby, and whether the job restarted (its generation and restarts after).

Last, the controller's CPU per node from a least-squares fit over the healthy sizes
(no step-down, operator calls answered, at least 90 % delivered), the
sizes one core would hold at that slope (10,000 and 16,384 nodes read off it), and
the figure: the CPU at the largest size against the smallest, per node (1.0 is
linear)::

    python -m benchmarks.control_plane [--sizes 100,1000,2000,4000] [--duration 60]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.etcd import connect
from common.procs import poll as wait_for
from common.procs import tied_to_this_process
from common.tls import call_metadata
from orchestrator.controller.store import Store
from orchestrator.local.etcd_server import EmbeddedEtcd, memory_backed_dir
from orchestrator.policy.lifecycle import WIRE_STATES
from protos import keel_pb2, keel_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"
AGENTS_PER_PROCESS = 500
CONNECT_S = 180.0  # the most a connect storm is waited for
# Agents start at this rate (each taking its etcd lease, then dialling): at 4,000 all
# at once, the load generator's eight processes starting together starved etcd on
# this machine's two cores, and the leader stepped down for it (2 runs of 5); a
# cluster's nodes boot over seconds. The failover is the storm at once.
START_RATE = 200.0  # agents a second
RANKS_PER_NODE = 8
TOKENS_PER_RANK_STEP = 4096  # what a simulated rank reports a step (simulated_agents)
STEP_S = 1.0  # each simulated node's step, seconds (its default)
# The load generator runs under SCHED_IDLE, on what CPU the controllers and etcd leave:
# on a cluster the agents are other machines. Here they share two cores with the
# controller under test: at its priority they took 1.4 cores at 4,000 nodes and starved
# it; at nice 10 their thirty-odd busy threads still outweighed etcd's few (the
# scheduler weighs threads, not processes), whose lease answers then took seconds and
# cost the leader its lease. Whether the generator still sent what it should is
# measured, not assumed: the steady window's tokens against nodes x ranks x 4,096 / s.
# (By ``chrt``, an exec: set in a preexec_fn, in a fork of this process and its gRPC
# threads, two generators of eight logged an epoll error and never connected an agent.)
IDLE_PRIORITY = ["chrt", "--idle", "0"]
# A size whose agents delivered less than this share of their step reports is left
# out of the slope: its controller CPU is for a lighter load than the nodes say.
DELIVERED_FOR_FIT = 0.9
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status(pid: int) -> dict[str, int]:
    """RSS (bytes) and thread count of ``pid``."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024
    threads = int(re.search(r"Threads:\s+(\d+)", text).group(1))
    return {"rss": rss, "threads": threads}


def etcd_writes(endpoint: str) -> float:
    """Puts and deletes etcd has applied so far (its /metrics; a busy etcd may take a
    while to answer: tried for a minute)."""
    for attempt in range(6):
        try:
            with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
                text = response.read().decode()
            break
        except OSError:  # (socket timeouts and URLError are OSErrors)
            if attempt == 5:
                raise
    total = 0.0
    for name in ("etcd_mvcc_put_total", "etcd_mvcc_delete_total"):
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        total += float(match.group(1)) if match else 0.0
    return total


@dataclass
class Size:
    nodes: int
    connect_s: float | None = None
    running_s: float | None = None
    cpu: float = 0.0  # the leader's, of one core, over the window
    rss: int = 0
    threads: int = 0
    rpc_ms: list[float] = field(default_factory=list)
    rpc_errors: int = 0
    etcd_writes_per_s: float = 0.0
    step_downs: int = 0
    generator_cpu: float = 0.0
    etcd_cpu: float = 0.0
    failover_s: float | None = None
    restarted: str = ""
    refusals: int = 0
    lease_renewals: int = 0  # simulated agents whose lease expired under load
    delivered: float | None = None  # steps the leader counted / steps the agents should send
    note: str = ""


class Generators:
    """The simulated agents' processes, and what they last said."""

    def __init__(self, nodes: int, etcd: str, controllers: list[str], log_dir: Path):
        count = max(1, math.ceil(nodes / AGENTS_PER_PROCESS))
        self.latest: list[dict] = [{} for _ in range(count)]
        self.summaries: list[dict] = []
        self.procs = []
        for index in range(count):
            share = nodes // count + (1 if index < nodes % count else 0)
            proc = subprocess.Popen(
                [
                    *IDLE_PRIORITY,
                    sys.executable,
                    "-m",
                    "benchmarks.simulated_agents",
                    "--etcd",
                    etcd,
                    "--controllers",
                    ",".join(controllers),
                    "--token",
                    TOKEN,
                    "--agents",
                    str(share),
                    "--prefix",
                    f"sim-{index}-",
                    "--ramp-s",
                    f"{nodes / START_RATE:g}",
                ],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log_dir / f"agents-{index}.log", "wb"),
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()

    def _read(self, index: int, proc) -> None:
        for line in proc.stdout:
            message = json.loads(line)
            if message.get("summary"):
                self.summaries.append(message)
            else:
                self.latest[index] = message.get("by", {})

    def connected_to(self, address: str) -> int:
        return sum(by.get(address, 0) for by in self.latest)

    def most_connected(self) -> tuple[str, int]:
        """The controller most agents are connected to, and how many."""
        counts: dict[str, int] = {}
        for by in self.latest:
            for address, count in by.items():
                counts[address] = counts.get(address, 0) + count
        return max(counts.items(), key=lambda item: item[1], default=("", 0))

    def cpu_s(self) -> float:
        return sum(cpu_s(p.pid) for p in self.procs if p.poll() is None)

    def stop(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_controller(name: str, etcd: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    address_file = workdir / f"{name}.address"
    proc = subprocess.Popen(  # dies with this script, however it ends (same pid: exec)
        [
            *tied_to_this_process(),
            sys.executable,
            "-m",
            "orchestrator.cli",
            "controller",
            "--etcd-endpoints",
            etcd,
            "--token-file",
            str(workdir / "token"),
            "--address-file",
            str(address_file),
            "--advertise-host",
            "127.0.0.1",
            "--listen",
            "127.0.0.1:0",
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=open(workdir / f"{name}.log", "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if not wait_for(address_file.exists, 60) or proc.poll() is not None:
        raise RuntimeError(
            f"controller {name} did not start: {(workdir / f'{name}.log').read_text()[-2000:]}"
        )
    return proc, address_file.read_text().strip()


def job_spec(nodes: int) -> keel_pb2.JobSpec:
    spec = keel_pb2.JobSpec(
        name="bench", world_size=nodes * RANKS_PER_NODE, command=["simulated"], max_restarts=3
    )
    spec.health.preflight_off = True
    spec.health.straggler_policy = keel_pb2.STRAGGLER_POLICY_ALERT
    return spec


def measure(nodes: int, duration_s: float, workdir: Path) -> Size:
    result = Size(nodes)
    workdir.mkdir(parents=True)
    (workdir / "token").write_text(TOKEN)
    # etcd's data in memory where there is a tmpfs: this machine's shared disk stalled
    # etcd's fsync for up to 2.5 s under the load generator ("slow fdatasync" in its
    # log), and the leader lease expired in it; a cluster's etcd has a disk of its own.
    etcd = EmbeddedEtcd(
        data_parent=memory_backed_dir() or workdir,
        log_path=workdir / "etcd.log",
        die_with_parent=True,
    ).start()
    procs: list[subprocess.Popen] = []
    generators = None
    try:
        store = Store(connect([etcd.endpoint], 5))
        leader, leader_address = start_controller("leader", etcd.endpoint, workdir)
        procs.append(leader)
        if not wait_for(lambda: store.controller_address() == leader_address, 30):
            raise RuntimeError("the first controller did not lead")
        standby, standby_address = start_controller("standby", etcd.endpoint, workdir)
        procs.append(standby)
        metadata = call_metadata(TOKEN)
        channel = grpc.insecure_channel(leader_address)
        stub = keel_pb2_grpc.ControllerStub(channel)
        stub.SubmitJob(
            keel_pb2.SubmitJobRequest(spec=job_spec(nodes)), metadata=metadata, timeout=30
        )

        began = time.monotonic()
        generators = Generators(nodes, etcd.endpoint, [leader_address, standby_address], workdir)
        if wait_for(lambda: generators.connected_to(leader_address) >= nodes, CONNECT_S, 0.1):
            result.connect_s = time.monotonic() - began
        else:
            address, count = generators.most_connected()
            whom = (
                "the first leader"
                if address == leader_address
                else "the standby (the first leader lost the lead)"
                if address
                else "none"
            )
            result.note = (
                f"{generators.connected_to(leader_address)}/{nodes} connected to the "
                f"first leader after {CONNECT_S:g} s; most ({count}) to {whom}; "
                f"{step_downs(workdir)} step-downs"
            )
            return result

        def job() -> keel_pb2.JobStatus | None:
            try:
                return stub.GetJob(
                    keel_pb2.GetJobRequest(job="bench"), metadata=metadata, timeout=30
                )
            except grpc.RpcError:
                return None

        if wait_for(
            lambda: (status := job()) is not None and status.state == keel_pb2.JOB_STATE_RUNNING,
            300,
            0.5,
        ):
            result.running_s = time.monotonic() - began
        else:
            result.note = f"the job did not run: {job()}"
            return result
        time.sleep(5)  # the start's messages settle

        # The steady window.
        calls = [
            ("ListNodes", keel_pb2.ListNodesRequest()),
            ("GetJob", keel_pb2.GetJobRequest(job="bench")),
            ("ListJobs", keel_pb2.ListJobsRequest()),
        ]
        first = job()
        writes0, t0 = etcd_writes(etcd.endpoint), time.monotonic()
        cpu0, gen0, etcd0 = cpu_s(leader.pid), generators.cpu_s(), cpu_s(etcd.proc.pid)
        logs0 = step_downs(workdir)
        peak = {"rss": 0, "threads": 0}
        index = 0
        while time.monotonic() - t0 < duration_s:
            name, request = calls[index % len(calls)]
            index += 1
            started = time.monotonic()
            try:
                getattr(stub, name)(request, metadata=metadata, timeout=10)
                result.rpc_ms.append((time.monotonic() - started) * 1000)
            except grpc.RpcError:
                result.rpc_errors += 1
            if index % 4 == 0:
                status = proc_status(leader.pid)
                peak = {k: max(peak[k], status[k]) for k in peak}
            time.sleep(max(0.0, 0.25 - (time.monotonic() - started)))
        elapsed = time.monotonic() - t0
        result.cpu = (cpu_s(leader.pid) - cpu0) / elapsed
        result.generator_cpu = (generators.cpu_s() - gen0) / elapsed
        result.etcd_cpu = (cpu_s(etcd.proc.pid) - etcd0) / elapsed
        result.etcd_writes_per_s = (etcd_writes(etcd.endpoint) - writes0) / elapsed
        result.step_downs = step_downs(workdir) - logs0
        result.rss, result.threads = peak["rss"], peak["threads"]
        before = job()
        # (Not after a step-down: the new leader counts the job's tokens from zero.)
        if first is not None and before is not None and not result.step_downs:
            should = nodes * RANKS_PER_NODE * TOKENS_PER_RANK_STEP / STEP_S
            result.delivered = (before.tokens - first.tokens) / elapsed / should
        channel.close()

        # The failover.
        leader.kill()
        leader.wait()
        killed = time.monotonic()
        if wait_for(lambda: generators.connected_to(standby_address) >= nodes, 120, 0.1):
            result.failover_s = time.monotonic() - killed
        stub = keel_pb2_grpc.ControllerStub(grpc.insecure_channel(standby_address))
        after = wait_for(job, 30)
        if after is None or before is None:
            result.restarted = "unknown (no answer)"
        elif (after.generation, after.restarts, after.state) != (
            before.generation,
            before.restarts,
            keel_pb2.JOB_STATE_RUNNING,
        ):
            result.restarted = (
                f"yes: generation {before.generation}→{after.generation}, "
                f"restarts {before.restarts}→{after.restarts}, {WIRE_STATES.text(after.state)}"
            )
        else:
            result.restarted = "no"
        return result
    finally:
        if generators is not None:
            generators.stop()
            result.refusals = sum(s.get("refusals", 0) for s in generators.summaries)
            result.lease_renewals = sum(s.get("lease_renewals", 0) for s in generators.summaries)
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        etcd.stop()


def step_downs(workdir: Path) -> int:
    return sum(
        path.read_text(errors="replace").count('"stepped down"')
        for path in workdir.glob("*.log")
        if path.stem in ("leader", "standby")
    )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def fmt(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="100,1000,2000,4000",
        help="comma-separated node counts, each measured from scratch",
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of the steady window at each size"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and etcd data")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="keel-control-plane-"))
    results = []
    for nodes in sizes:
        print(f"measuring {nodes} nodes ...", file=sys.stderr, flush=True)
        result = measure(nodes, args.duration, root / str(nodes))
        results.append(result)
        print(
            json.dumps({k: v for k, v in result.__dict__.items() if k != "rpc_ms"}),
            file=sys.stderr,
            flush=True,
        )
    print(
        f"\ncontrol plane, {RANKS_PER_NODE} ranks per node, steady window {args.duration:g} s "
        f"(CPU: seconds per second, of one core)"
    )
    header = (
        "nodes",
        "connect",
        "running",
        "ctl CPU",
        "RSS",
        "threads",
        "RPC p50",
        "RPC p99",
        "etcd w/s",
        "downs",
        "gen CPU",
        "delivered",
        "etcd CPU",
        "gen leases lost",
        "failover",
        "restarted",
    )
    print(" | ".join(header))
    for r in results:
        print(
            " | ".join(
                [
                    str(r.nodes),
                    fmt(r.connect_s, ".1f", " s"),
                    fmt(r.running_s, ".1f", " s"),
                    f"{r.cpu * 100:.1f} %",
                    f"{r.rss / 2**20:.0f} MiB",
                    str(r.threads),
                    fmt(percentile(r.rpc_ms, 0.5), ".1f", " ms"),
                    fmt(percentile(r.rpc_ms, 0.99), ".1f", " ms")
                    + (f" ({r.rpc_errors} failed)" if r.rpc_errors else ""),
                    f"{r.etcd_writes_per_s:.2f}",
                    str(r.step_downs),
                    f"{r.generator_cpu * 100:.0f} %",
                    fmt(None if r.delivered is None else r.delivered * 100, ".0f", " %"),
                    f"{r.etcd_cpu * 100:.0f} %",
                    str(r.lease_renewals),
                    fmt(r.failover_s, ".1f", " s"),
                    r.restarted or "n/a",
                ]
            )
            + (f"  [{r.note}]" if r.note else "")
        )
    # Only sizes whose steady window was healthy: a leader that answered no operator
    # call or stepped down was blocked, not cheap, and its CPU says nothing of the cost;
    # nor does it where the agents sent much less than they should.
    fitted = [
        r
        for r in results
        if r.running_s is not None
        and r.rpc_ms
        and not r.step_downs
        and (r.delivered or 0) >= DELIVERED_FOR_FIT
    ]
    left_out = [r.nodes for r in results if r.running_s is not None and r not in fitted]
    if left_out:
        print(
            f"\nleft out of the fit (no operator call answered, a step-down in the "
            f"steady window, or under {DELIVERED_FOR_FIT:.0%} of the steps delivered): "
            f"{', '.join(map(str, left_out))} nodes"
        )
    if len(fitted) >= 2:
        xs, ys = [r.nodes for r in fitted], [r.cpu for r in fitted]
        slope, intercept = statistics.linear_regression(xs, ys)
        print(
            f"\ncontroller CPU per node (least squares over {len(fitted)} sizes): "
            f"{slope * 1e6:.1f} µs per node-second, intercept {intercept * 100:.1f} %"
        )
        for n in (10_000, 16_384):
            print(
                f"  at {n} nodes: {(intercept + slope * n) * 100:.0f} % of one core (extrapolated)"
            )
        if slope > 0:
            print(f"  one core holds about {(1 - intercept) / slope:,.0f} nodes at this slope")
        small, large = fitted[0], fitted[-1]
        if small.cpu > 0:
            print(
                f"CPU per node at {large.nodes} against {small.nodes} nodes: "
                f"{(large.cpu / large.nodes) / (small.cpu / small.nodes):.2f} (1.00 is linear)"
            )
    if args.keep or any(r.note for r in results):
        print(f"logs kept in {root}" + ("" if args.keep else " (a size failed)"), file=sys.stderr)
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
