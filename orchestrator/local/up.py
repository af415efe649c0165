"""``keel up``: a whole local cluster on this machine, running one job to its end.

Starts etcd (embedded unless endpoints are given), one controller and N agents as
separate processes, submits the job, shows its progress, and shuts everything down in
order (agents, which stop their ranks; the controller; etcd) before printing a summary.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import json_format

from common.tls import call_metadata
from orchestrator.security.certs import init_once
from orchestrator.local.etcd_server import EmbeddedEtcd
from orchestrator import planner
from orchestrator.local.faults import CLUSTER_FAULTS, parse_schedule
from orchestrator.spec.jobspec import validate
from orchestrator.policy.lifecycle import JobState
from orchestrator.local.ledger_check import audit_checkpoint
from common import env
from common.procs import terminate, tied_to_this_process
from common.etcd import connect
from orchestrator.controller.store import Store
from common.etcd import EtcdCredentials, host_port
from common.tls import TlsFiles, channel, etcd_flags, resolve_tls
from protos import keel_pb2, keel_pb2_grpc

JOB_NAME = "keel-up"
ETCD_DOWN_S = 2.0    # restart_etcd: how long etcd stays down unless its down= says
POLL_S = 0.5
# The reference trainer's model and batch, passed to it explicitly so that the shape the
# controller validates and plans with is the one that trains.
REFERENCE = {"dim": 64, "layers": 2, "heads": 4, "vocab": 256, "seq_len": 64,
             "global_batch": 16}


@dataclass(frozen=True)
class UpOptions:
    nodes: int = 2
    slots_per_node: int = 2
    steps: int = 40
    checkpoint_every: int = 10
    script: str | None = None
    script_args: tuple[str, ...] = ()
    inject: tuple[str, ...] = ()
    layout: str | None = None        # None: dp_shard over every rank; "auto": the planner's
    min_nodes: int = 1               # after losing nodes, shrink down to this many
    spares: int = 0                  # extra agents that wait as hot spares
    controllers: int = 1             # more than one: standbys take over from the leader
    straggler_policy: str = "replace"
    hang_timeout_s: float = 30.0     # floor of the hang timeout (k x median step above it)
    preflight: bool = True
    max_restarts: int = 3
    etcd_endpoints: tuple[str, ...] = ()
    workdir: Path | None = None
    timeout_s: float = 3600.0
    lease_ttl_s: float = 5.0
    stop_grace_s: float = 5.0
    tls: bool = False                # mutual TLS and role tokens, from <workdir>/tls
    etcd_credentials: EtcdCredentials | None = None  # of the --etcd-endpoints cluster
    json: bool = False

    def __post_init__(self):
        if self.nodes < 1 or self.slots_per_node < 1:
            raise ValueError("--nodes and --slots-per-node must be at least 1")
        if self.steps < 1:
            raise ValueError("--steps must be at least 1")
        if self.checkpoint_every < 1:
            raise ValueError("--checkpoint-every must be at least 1")
        if self.script is not None and not Path(self.script).is_file():
            raise ValueError(f"--script {self.script}: no such file")
        if self.timeout_s <= 0:
            raise ValueError("--timeout-s must be positive")
        if not 0 <= self.min_nodes <= self.nodes:
            raise ValueError(f"--min-nodes must be between 0 and --nodes ({self.nodes})")
        if self.spares < 0:
            raise ValueError("--spares must be 0 or more")
        if self.controllers < 1:
            raise ValueError("--controllers must be at least 1")
        if self.etcd_credentials and not self.etcd_endpoints:
            raise ValueError("--etcd-ca/--etcd-cert/--etcd-key/--etcd-user are for the etcd "
                             "of --etcd-endpoints; the embedded one needs none")
        for endpoint in self.etcd_endpoints:
            host_port(endpoint)

    @property
    def world_size(self) -> int:
        return self.nodes * self.slots_per_node


@dataclass
class LocalCluster:
    """The processes of a local cluster, started and stopped in order."""
    options: UpOptions
    workdir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    etcd: EmbeddedEtcd | None = None
    controllers: list[subprocess.Popen] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)   # of each controller, in order
    agents: list[subprocess.Popen] = field(default_factory=list)
    client_tls: TlsFiles | None = None   # keel up's own certificate, with --tls
    agent_credentials: list[str] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        return ",".join(self.options.etcd_endpoints) or self.etcd.endpoint

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        with open(self.workdir / "logs" / log_name, "ab") as log:
            return subprocess.Popen([*tied_to_this_process(), sys.executable, *args],
                                    stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def _credentials(self) -> list[str]:
        """The daemons' credential flags. Plain: one token for everything. With --tls:
        a CA and certificates in <workdir>/tls, agents given only the join token and
        keel up itself the operator's. Then the etcd credentials, if any."""
        etcd = etcd_flags(self.options.etcd_credentials)
        if self.options.etcd_credentials and self.options.etcd_credentials.password:
            # The daemons inherit it from here: a flag would show in ps.
            os.environ[env.ETCD_PASSWORD] = self.options.etcd_credentials.password
        if not self.options.tls:
            token_file = self.workdir / "token"
            token_file.touch(mode=0o600)
            token_file.write_text(self.token)
            return ["--token-file", str(token_file), *etcd]
        tls_dir = init_once(self.workdir / "tls")
        self.token = (tls_dir / "operator.token").read_text().strip()
        self.client_tls = resolve_tls(tls_dir, "operator")
        return ["--tls-dir", str(tls_dir), *etcd]

    def start(self) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        credentials = self._credentials()
        if not self.options.etcd_endpoints:
            self.etcd = EmbeddedEtcd(log_path=self.workdir / "logs" / "etcd.log",
                                     data_parent=self.workdir, die_with_parent=True).start()
        for i in range(self.options.controllers):
            address_file = self.workdir / f"controller-{i}.address"
            address_file.unlink(missing_ok=True)
            log_name = "controller.log" if i == 0 else f"controller-{i}.log"
            controller = self._spawn(
                ["-m", "orchestrator.cli", "controller", "--etcd-endpoints", self.endpoints,
                 *credentials, "--address-file", str(address_file)],
                log_name)
            self.controllers.append(controller)
            deadline = time.monotonic() + 30
            while not address_file.exists():
                if controller.poll() is not None:
                    raise RuntimeError(f"controller exited with code {controller.returncode}; "
                                       f"see {self.workdir / 'logs' / log_name}")
                if time.monotonic() > deadline:
                    raise RuntimeError("controller did not start within 30 s")
                time.sleep(0.05)
            self.addresses.append(address_file.read_text().strip())
        self.agent_credentials = credentials
        for i in range(self.options.nodes + self.options.spares):
            self.agents.append(self.start_agent(i))

    def start_agent(self, index: int) -> subprocess.Popen:
        """Agent ``node-INDEX``, on its run directory (a restarted one finds there what
        its predecessor left running)."""
        return self._spawn(
            ["-m", "agent", "--node", f"node-{index}",
             "--slots", str(self.options.slots_per_node),
             "--etcd-endpoints", self.endpoints, *self.agent_credentials,
             "--run-dir", str(self.workdir / "nodes" / f"node-{index}"),
             "--lease-ttl-s", str(self.options.lease_ttl_s),
             "--stop-grace-s", str(self.options.stop_grace_s)],
            f"agent-node-{index}.log")

    def stop(self) -> None:
        """Agents first (they stop their ranks), then the controller, then etcd."""
        grace = self.options.stop_grace_s + 5
        terminate(self.agents, grace)
        terminate(self.controllers, grace)
        if self.etcd is not None:
            self.etcd.stop()


def _slot_memory_gb(slots: int) -> float:
    """This machine's memory shared out among the slots (the CPU stands in for GPUs)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9 / slots


def job_spec(options: UpOptions, checkpoint_dir: Path) -> keel_pb2.JobSpec:
    """The job `keel up` submits; raises InvalidSpec or BadFault before anything starts."""
    spec = keel_pb2.JobSpec(name=JOB_NAME, world_size=options.world_size,
                            max_restarts=options.max_restarts, min_nodes=options.min_nodes,
                            checkpoint_dir=str(checkpoint_dir),
                            mesh=options.layout or f"dp_shard={options.world_size}")
    if options.script:
        spec.command.extend([sys.executable, "-u", str(Path(options.script).resolve()),
                             *options.script_args])
    else:
        spec.command.extend([sys.executable, "-u", "-m", "trainer.train",
                             "--steps", str(options.steps),
                             "--checkpoint-every", str(options.checkpoint_every),
                             *(f"--{k.replace('_', '-')}={v}" for k, v in REFERENCE.items())])
        spec.steps = options.steps
        shape = planner.ModelShape.from_dims(layers=REFERENCE["layers"],
                                             hidden=REFERENCE["dim"],
                                             heads=REFERENCE["heads"], vocab=REFERENCE["vocab"])
        spec.model.CopyFrom(keel_pb2.ModelShape(
            params=shape.params, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
            vocab=shape.vocab))
        spec.training.CopyFrom(keel_pb2.TrainingShape(
            seq_len=REFERENCE["seq_len"], micro_batch=1,
            global_batch=REFERENCE["global_batch"], precision="fp32",
            gpu_memory_gb=_slot_memory_gb(options.world_size)))
    spec.health.CopyFrom(keel_pb2.HealthSpec(
        straggler_policy=options.straggler_policy, hang_floor_s=options.hang_timeout_s,
        first_step_timeout_s=max(options.hang_timeout_s, 120.0),
        checkpoint_timeout_s=max(options.hang_timeout_s, 120.0),
        preflight_off=not options.preflight))
    schedule = parse_schedule(list(options.inject), options.world_size,
                              options.nodes + options.spares)
    _check_cluster_can_fire(schedule, options)
    if schedule.faults:
        spec.env[env.FAULTS] = json_format.MessageToJson(schedule, indent=None)
    validate(spec)
    return spec



def _check_cluster_can_fire(schedule: keel_pb2.FaultSchedule, options: UpOptions) -> None:
    """Refuse faults that this cluster and job could never fire, or not survive as
    the fault intends; raises ValueError naming the fix."""
    faults = list(schedule.faults)
    if not options.script:
        late = [f for f in faults if f.step > options.steps]
        if late:
            raise ValueError(f"{late[0].kind} at step {late[0].step} would never fire: the "
                             f"job runs --steps {options.steps}")
    if options.etcd_endpoints and any(f.kind == "restart_etcd" for f in faults):
        raise ValueError("restart_etcd restarts the embedded etcd; drop --etcd-endpoints "
                         "(and unset KEEL_ETCD_ENDPOINTS)")
    leader_kills = sum(1 for f in faults if f.kind == "kill_leader")
    if leader_kills >= options.controllers:
        raise ValueError(f"{leader_kills} kill_leader fault(s) need as many standbys: give "
                         f"--controllers {leader_kills + 1}")
    lost = [f.node for f in faults if f.kind == "lose_node"]
    twice = sorted({n for n in lost if lost.count(n) > 1})
    if twice:
        raise ValueError(f"node {twice[0]} is lost twice; lose_node kills it for good")
    restarted = sorted({f.node for f in faults if f.kind == "kill_agent"} & set(lost))
    if restarted:
        raise ValueError(f"node {restarted[0]} is lost by lose_node; kill_agent cannot "
                         f"also restart its agent")

@dataclass
class ClusterFaults:
    """The schedule's faults that `keel up` fires itself once rank 0 reports their step:
    ``lose_node`` kills an agent's process group (its ranks die with it through their
    parent-death signal), ``kill_leader`` SIGKILLs the leading controller,
    ``restart_etcd`` crashes etcd and starts it again on its data after its
    ``down_s`` (``ETCD_DOWN_S`` by default), and ``kill_agent`` SIGKILLs an agent and
    starts it again."""
    pending: list[keel_pb2.Fault]
    lost: set[int] = field(default_factory=set)              # agent indexes
    killed_controllers: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, spec: keel_pb2.JobSpec) -> "ClusterFaults":
        if env.FAULTS not in spec.env:
            return cls([])
        schedule = json_format.Parse(spec.env[env.FAULTS], keel_pb2.FaultSchedule())
        return cls([f for f in schedule.faults if f.kind in CLUSTER_FAULTS])

    def fire(self, step: int, cluster: "LocalCluster", leader: str | None) -> list[str]:
        fired = []
        for fault in [f for f in self.pending if step >= f.step]:
            if fault.kind == "lose_node":
                agent = cluster.agents[fault.node]
                os.killpg(agent.pid, signal.SIGKILL)
                self.lost.add(fault.node)
                fired.append(f"injected: node-{fault.node} lost (agent pid {agent.pid} and "
                             f"its ranks killed) at step {step}")
            elif fault.kind == "kill_agent":
                agent = cluster.agents[fault.node]
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
                cluster.agents[fault.node] = cluster.start_agent(fault.node)
                fired.append(f"injected: node-{fault.node}'s agent (pid {agent.pid}) killed "
                             f"at step {step} and started again (pid "
                             f"{cluster.agents[fault.node].pid})")
            elif fault.kind == "restart_etcd":
                down_s = fault.down_s or ETCD_DOWN_S
                cluster.etcd.restart(down_s=down_s)
                fired.append(f"injected: etcd killed at step {step}, back after "
                             f"{down_s:g} s on its data")
            elif leader in cluster.addresses:
                index = cluster.addresses.index(leader)
                os.killpg(cluster.controllers[index].pid, signal.SIGKILL)
                self.killed_controllers.add(index)
                fired.append(f"injected: leader controller {leader} killed at step {step}")
            else:
                continue  # no leader right now: fire once one leads
            self.pending.remove(fault)
        return fired


class LeaderClient:
    """Calls the leading controller, found in etcd, following it when it changes."""

    def __init__(self, endpoints: list[str], token: str, wait_s: float = 60.0,
                 tls_files: TlsFiles | None = None,
                 etcd_credentials: EtcdCredentials | None = None):
        self.store = Store(connect(endpoints, 5.0, etcd_credentials))
        self.metadata = call_metadata(token)
        self.tls_files = tls_files
        self.wait_s = wait_s
        self.address: str | None = None
        self.channel: grpc.Channel | None = None
        self.leaders: list[str] = []     # every leader seen, in order

    def _stub(self) -> keel_pb2_grpc.ControllerStub:
        leader = self.store.leader()
        if leader is None:
            raise NoLeader("no controller leads yet")
        if leader["address"] != self.address:
            if self.channel is not None:
                self.channel.close()
            self.address = leader["address"]
            self.channel = channel(self.address, self.tls_files)
        if not self.leaders or self.leaders[-1] != leader["id"]:
            self.leaders.append(leader["id"])
        return keel_pb2_grpc.ControllerStub(self.channel)

    def call(self, method: str, request):
        """One call to the leader; while there is none (a failover), retry for up to
        ``wait_s`` seconds."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return getattr(self._stub(), method)(request, metadata=self.metadata,
                                                     timeout=10)
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE or \
                        time.monotonic() > deadline:
                    raise
            except Exception as exc:  # no leader yet, or etcd briefly unreachable
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no leading controller within {self.wait_s:.0f} s: "
                                       f"{exc}") from exc
            time.sleep(0.2)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


class NoLeader(Exception):
    pass


class Progress:
    """Live progress on stderr: one rewritten line on a terminal, else a line per change."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.failures_shown = 0
        self.events_shown = 0

    def show(self, status: keel_pb2.JobStatus) -> None:
        for failure in status.failures[self.failures_shown:]:
            self._line(f"generation {failure.generation} failed: rank {failure.rank} on "
                       f"{failure.node} " + (f"killed by signal {failure.signal}"
                                             if failure.signal else
                                             f"exited {failure.exit_code}")
                       + f" after step {failure.last_step}"
                       + (f" — {failure.traceback.strip().splitlines()[-1]}"
                          if failure.traceback.strip() else ""))
        self.failures_shown = len(status.failures)
        for event in status.events[self.events_shown:]:
            if event.kind != "crash":  # crashes are shown above with their traceback
                self._line(f"event: {event.kind} {event.node} — {event.reason}"
                           + (f"; {event.root_cause.splitlines()[0]}"
                              if event.kind == "hang" and event.root_cause else ""))
        self.events_shown = len(status.events)
        target = f"/{status.target_steps}" if status.target_steps else ""
        loss = f"{status.loss:.4f}" if status.has_loss else "-"
        text = (f"{status.state:<9} gen {status.generation} world {status.world_size} "
                f"step {status.step}{target} loss {loss} "
                f"{status.tokens_per_s:,.0f} tok/s restarts {status.restarts}")
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
            self.last = text
        elif self._key(text) != self._key(self.last):
            self._line(text)
            self.last = text

    @staticmethod
    def _key(text: str) -> str:
        # Off a terminal, print on state/generation changes and every 5th step only.
        parts = text.split()
        if len(parts) < 7:
            return text
        step = parts[6].split("/")[0]
        return " ".join(parts[:6]) + f" {int(step) // 5 if step.isdigit() else step}"

    def note(self, text: str) -> None:
        self._line(text)

    def _line(self, text: str) -> None:
        if self.tty and self.last:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")
            sys.stderr.flush()


def summarize(status: keel_pb2.JobStatus | None, wall_s: float, workdir: Path,
              error: str = "") -> dict:
    if status is None:
        return {"state": "NOT_STARTED", "reason": error, "steps": 0, "initial_loss": None,
                "final_loss": None, "world_size": 0, "layout": "", "generations": 0,
                "restarts": 0, "data": None, "events": [], "preflight": [],
                "wall_s": round(wall_s, 2), "workdir": str(workdir), "failures": []}
    return {
        "job": status.job, "state": status.state, "reason": error or status.reason,
        "steps": status.step, "target_steps": status.target_steps,
        "initial_loss": status.initial_loss if status.has_loss else None,
        "final_loss": status.loss if status.has_loss else None,
        "world_size": status.world_size, "layout": status.mesh,
        "generations": status.generation,
        "restarts": status.restarts, "tokens": status.tokens, "wall_s": round(wall_s, 2),
        "last_checkpoint": ({"step": status.last_checkpoint.step,
                             "path": status.last_checkpoint.path}
                            if status.HasField("last_checkpoint") else None),
        "failures": [{"generation": f.generation, "node": f.node, "rank": f.rank,
                      "pid": f.pid, "exit_code": f.exit_code, "signal": f.signal,
                      "last_step": f.last_step, "traceback": f.traceback}
                     for f in status.failures],
        "data": _data_audit(status),
        "events": [_event_json(e) for e in status.events],
        "preflight": [{"node": p.node, "generation": p.generation, "slow": p.slow,
                       "results": [{"collective": r.collective, "size_bytes": r.size_bytes,
                                    "time_s": r.time_s, "algbw_gbps": r.algbw_gbps,
                                    "busbw_gbps": r.busbw_gbps} for r in p.results]}
                      for p in status.preflight],
        "workdir": str(workdir),
    }


def _wait_for_agents(client: LeaderClient, count: int, workdir: Path,
                     timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = client.call("ListNodes", keel_pb2.ListNodesRequest()).nodes
        if sum(1 for n in nodes if n.connected) >= count:
            return
        time.sleep(0.1)
    raise RuntimeError(f"only {sum(1 for n in nodes if n.connected)}/{count} agents joined "
                       f"within {timeout_s:.0f} s; see {workdir / 'logs'}")


def _event_json(event: keel_pb2.Event) -> dict:
    out = {"kind": event.kind, "node": event.node,
           "rank": event.rank if event.HasField("rank") else None, "step": event.step,
           "generation": event.generation, "reason": event.reason}
    if event.kind in ("crash", "hang", "node_lost"):
        out["detected_after_s"] = round(event.detected_after_s, 3)
    if event.kind == "straggler":
        out["detected_after_steps"] = event.detected_after_steps
    if event.root_cause:
        out["root_cause"] = event.root_cause
    if event.stacks:
        out["stacks"] = {str(rank): stack for rank, stack in sorted(event.stacks.items())}
    return out


def _data_audit(status: keel_pb2.JobStatus) -> dict | None:
    """The final checkpoint's data ledger audited, or None without one (e.g. a script)."""
    if not status.HasField("last_checkpoint"):
        return None
    try:
        return audit_checkpoint(Path(status.last_checkpoint.path))
    except (FileNotFoundError, KeyError, ValueError):
        return None


def succeeded(summary: dict) -> bool:
    return summary["state"] == "SUCCEEDED" and summary["steps"] >= summary.get("target_steps", 0)


def print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    loss = ""
    if summary["initial_loss"] is not None:
        loss = f", loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}"
    print(f"{summary['state']}: {summary['steps']} steps at world size "
          f"{summary['world_size']} ({summary.get('layout') or '-'}){loss}; "
          f"{summary['generations']} generation(s), {summary['restarts']} restart(s), "
          f"{summary['wall_s']:.1f} s")
    if summary.get("data"):
        data = summary["data"]
        print(f"  data: {data['consumed']}/{data['expected']} samples consumed, "
              f"{data['duplicates']} duplicated, {data['missing']} missing")
    for failure in summary["failures"]:
        how = (f"signal {failure['signal']}" if failure["signal"]
               else f"exit code {failure['exit_code']}")
        print(f"  generation {failure['generation']}: rank {failure['rank']} on "
              f"{failure['node']} (pid {failure['pid']}) {how} after step "
              f"{failure['last_step']}")
    if summary.get("reason"):
        print(f"  reason: {summary['reason']}")
    print(f"  logs and checkpoints: {summary['workdir']}")


def up(options: UpOptions) -> int:
    started = time.monotonic()
    workdir = (options.workdir or Path(tempfile.mkdtemp(prefix="keel-up-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = job_spec(options, workdir / "checkpoints")  # validates --inject before any start
    cluster = LocalCluster(options, workdir)
    faults = ClusterFaults.of(spec)
    status, error, leader_changes = None, "", 0
    failovers_s: list[float] = []     # from killing a leader to its successor answering
    killed_at = None
    stop = []
    previous = {sig: signal.signal(sig, lambda *_: stop.append(1))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    progress = Progress()
    try:
        cluster.start()
        client = LeaderClient(cluster.endpoints.split(","), cluster.token,
                              tls_files=cluster.client_tls,
                              etcd_credentials=options.etcd_credentials)
        try:
            # Every agent joins before the job is submitted, so the placement is by node
            # name and the spares are the last nodes, whatever order they started in.
            _wait_for_agents(client, options.nodes + options.spares, workdir)
            client.call("SubmitJob", keel_pb2.SubmitJobRequest(spec=spec))
            credentials = " ".join([*(["--tls-dir", str(workdir / "tls")] if options.tls
                                      else ["--token-file", str(workdir / "token")]),
                                    *etcd_flags(options.etcd_credentials)])
            progress.note(f"job {spec.name} submitted; from another shell: keel status "
                          f"--etcd-endpoints {cluster.endpoints} {credentials}")
            deadline = time.monotonic() + options.timeout_s
            while True:
                status = client.call("GetJob", keel_pb2.GetJobRequest(job=spec.name))
                if len(client.leaders) - 1 > leader_changes and killed_at is not None:
                    failovers_s.append(round(time.monotonic() - killed_at, 2))
                    killed_at = None
                leader_changes = len(client.leaders) - 1
                progress.show(status)
                for line in faults.fire(status.step, cluster, client.address):
                    progress.note(line)
                    if "leader controller" in line:
                        killed_at = time.monotonic()
                if JobState(status.state).terminal:
                    break
                if stop:
                    error = "interrupted"
                    break
                if time.monotonic() > deadline:
                    error = f"timed out after {options.timeout_s:.0f} s"
                    break
                if any(a.poll() is not None for i, a in enumerate(cluster.agents)
                       if i not in faults.lost) or \
                        any(c.poll() is not None for i, c in enumerate(cluster.controllers)
                            if i not in faults.killed_controllers):
                    error = f"a daemon exited unexpectedly; see {workdir / 'logs'}"
                    break
                time.sleep(POLL_S)
        finally:
            client.close()
    except (RuntimeError, grpc.RpcError) as exc:
        error = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
    finally:
        progress.done()
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = summarize(status, time.monotonic() - started, workdir, error)
    summary["leader_changes"] = leader_changes
    summary["failovers_s"] = failovers_s
    print_summary(summary, options.json)
    if succeeded(summary) and not error:
        return 0
    if not options.json:
        print(f"keel up failed: {error or summary['reason']}", file=sys.stderr)
    return 1
