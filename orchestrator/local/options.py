"""What ``keel up`` is asked to do (``UpOptions``, validated on construction), and the
job spec it submits for it: the reference trainer (or a script) at the cluster's
world size, with the faults to inject. Everything here is checked before anything
starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from common import env
from common.etcd import EtcdCredentials, host_port
from common.wire_kinds import FaultKind
from orchestrator import planner
from orchestrator.local.faults import kind_of, parse_schedule
from orchestrator.policy.remediation import WIRE_STRAGGLER_POLICIES, StragglerPolicy
from orchestrator.spec.jobspec import validate
from protos import keel_pb2

JOB_NAME = "keel-up"
# The reference trainer's model and batch, passed to it explicitly so that the shape the
# controller validates and plans with is the one that trains.
REFERENCE = {"dim": 64, "layers": 2, "heads": 4, "vocab": 256, "seq_len": 64, "global_batch": 16}


def reference_global_batch(world_size: int) -> int:
    """The reference trainer's samples per step at ``world_size``: the smallest multiple
    of its 16 that the world size divides (every rank data-parallel: 48 for 3 ranks)."""
    return REFERENCE["global_batch"] * world_size // math.gcd(REFERENCE["global_batch"], world_size)


@dataclass(frozen=True)
class UpOptions:
    nodes: int = 2
    slots_per_node: int = 2
    steps: int = 40
    checkpoint_every: int = 10
    script: str | None = None
    script_args: tuple[str, ...] = ()
    inject: tuple[str, ...] = ()
    layout: str | None = None  # None: dp_shard over every rank; "auto": the planner's
    min_nodes: int = 1  # after losing nodes, shrink down to this many
    spares: int = 0  # extra agents that wait as hot spares
    controllers: int = 1  # more than one: standbys take over from the leader
    straggler_policy: str = "replace"
    hang_floor_s: float = 30.0  # the hang timeout's floor (k x median step above it)
    first_step_timeout_s: float = 0.0  # 0: 120 s, or the floor if longer
    collective_timeout_s: float = 0.0  # 0: derived from the floor (common.deadlines)
    preflight: bool = True
    max_restarts: int = 3
    etcd_endpoints: tuple[str, ...] = ()
    etcd_members: int = 1  # of the embedded etcd
    workdir: Path | None = None
    timeout_s: float = 3600.0
    linger_s: float = 0.0  # the cluster stays up this long after the job ends
    lease_ttl_s: float = 5.0
    stop_grace_s: float = 5.0
    tls: bool = False  # mutual TLS and role tokens, from <workdir>/tls
    etcd_credentials: EtcdCredentials | None = None  # of the --etcd-endpoints cluster
    json: bool = False
    log_format: str = "json"  # of the daemons and ranks (common.logs)
    log_level: str = "info"
    resume_from: str = ""  # absolute: a checkpoint, or a directory of them, to start from
    rank_user: str = ""  # ranks run as this user (orchestrator.local.rank_user); "" = as keel up
    memory_budget_gb: float = 0.0  # each agent's memory for the job's snapshots; 0 = none
    # Each node's failure domain, by index (nodes, then spares): its snapshots' copies go
    # to a partner outside it. (): none said.
    failure_domains: tuple[str, ...] = ()
    replication_mbps: float | None = None  # the agents' bound on a copy; None = theirs
    # When agents fill their warm processes (eager, lazy); "": the agents' default
    # (KEEL_WARM_FILL, else eager).
    warm_fill: str = ""

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
        if self.linger_s < 0:
            raise ValueError("--linger-s must be 0 (stop at once) or more")
        if not 0 <= self.min_nodes <= self.nodes:
            raise ValueError(f"--min-nodes must be between 0 and --nodes ({self.nodes})")
        if self.warm_fill and self.warm_fill not in env.WARM_FILLS:
            raise ValueError(
                f"warm fill {self.warm_fill!r}: must be one of {', '.join(env.WARM_FILLS)}"
            )
        if self.memory_budget_gb < 0:
            raise ValueError("--memory-budget-gb must be 0 (no memory tier) or more")
        if self.spares < 0:
            raise ValueError("--spares must be 0 or more")
        if self.failure_domains and len(self.failure_domains) != self.nodes + self.spares:
            raise ValueError(
                f"--failure-domains names {len(self.failure_domains)} domains: give one per "
                f"node, spares last ({self.nodes + self.spares}), e.g. rack-a,rack-a,rack-b"
            )
        if self.replication_mbps is not None and self.replication_mbps < 0:
            raise ValueError("--replication-mbps must be 0 (no bound) or more")
        if self.controllers < 1:
            raise ValueError("--controllers must be at least 1")
        if self.etcd_credentials and not self.etcd_endpoints:
            raise ValueError(
                "--etcd-ca/--etcd-cert/--etcd-key/--etcd-user are for the etcd "
                "of --etcd-endpoints; the embedded one needs none"
            )
        for endpoint in self.etcd_endpoints:
            host_port(endpoint)
        if self.etcd_members not in (1, 3, 5):
            raise ValueError(f"--etcd-members {self.etcd_members}: give 1, 3 or 5")
        if self.etcd_members > 1 and self.etcd_endpoints:
            raise ValueError(
                "--etcd-members sizes the embedded etcd; drop it with --etcd-endpoints"
            )
        if self.resume_from and not os.path.isdir(self.resume_from):
            raise ValueError(
                f"--resume-from {self.resume_from}: no such directory (give a committed "
                f"checkpoint, step_N, or a checkpoint directory)"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.slots_per_node


def _slot_memory_gb(slots: int) -> float:
    """This machine's memory shared out among the slots (the CPU stands in for GPUs)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9 / slots


def job_spec(options: UpOptions, checkpoint_dir: Path) -> keel_pb2.JobSpec:
    """The job `keel up` submits; raises InvalidSpec or BadFault before anything starts."""
    spec = keel_pb2.JobSpec(
        name=JOB_NAME,
        world_size=options.world_size,
        max_restarts=options.max_restarts,
        min_nodes=options.min_nodes,
        checkpoint_dir=str(checkpoint_dir),
        mesh=options.layout or f"dp_shard={options.world_size}",
        resume_from=os.path.abspath(options.resume_from) if options.resume_from else "",
    )
    if options.script:
        spec.command.extend(
            [sys.executable, "-u", str(Path(options.script).resolve()), *options.script_args]
        )
    else:
        reference = REFERENCE | {"global_batch": reference_global_batch(options.world_size)}
        argv = [
            "--steps",
            str(options.steps),
            "--checkpoint-every",
            str(options.checkpoint_every),
            *(f"--{k.replace('_', '-')}={v}" for k, v in reference.items()),
        ]
        if options.script_args:
            reference = _with_trainer_args(reference, argv, options.script_args)
        spec.command.extend(
            [sys.executable, "-u", "-m", "trainer.train", *argv, *options.script_args]
        )
        spec.steps = options.steps
        shape = planner.ModelShape.from_dims(
            layers=reference["layers"],
            hidden=reference["dim"],
            heads=reference["heads"],
            vocab=reference["vocab"],
        )
        spec.model.CopyFrom(
            keel_pb2.ModelShape(
                params=shape.params,
                layers=shape.layers,
                hidden=shape.hidden,
                heads=shape.heads,
                vocab=shape.vocab,
            )
        )
        spec.training.CopyFrom(
            keel_pb2.TrainingShape(
                seq_len=reference["seq_len"],
                micro_batch=1,
                global_batch=reference["global_batch"],
                precision=keel_pb2.PRECISION_FP32,
                gpu_memory_gb=_slot_memory_gb(options.world_size),
            )
        )
    spec.health.CopyFrom(
        keel_pb2.HealthSpec(
            straggler_policy=WIRE_STRAGGLER_POLICIES.to_wire(
                StragglerPolicy(options.straggler_policy)
            ),
            hang_floor_s=options.hang_floor_s,
            first_step_timeout_s=options.first_step_timeout_s or max(options.hang_floor_s, 120.0),
            checkpoint_timeout_s=max(options.hang_floor_s, 120.0),
            stop_grace_s=options.stop_grace_s,
            collective_timeout_s=options.collective_timeout_s,
            preflight_off=not options.preflight,
        )
    )
    schedule = parse_schedule(
        list(options.inject), options.world_size, options.nodes + options.spares
    )
    _check_cluster_can_fire(schedule, options)
    if schedule.faults:
        spec.env[env.FAULTS] = json_format.MessageToJson(schedule, indent=None)
    spec.env[env.LOG_FORMAT], spec.env[env.LOG_LEVEL] = options.log_format, options.log_level
    validate(spec)
    return spec


# The reference trainer's flags keel up sets from its own options (or the job's
# environment): passed after `--` they would contradict what the controller plans.
OWNED_TRAINER_FLAGS = {
    "--steps": "--steps",
    "--checkpoint-every": "--checkpoint-every",
    "--checkpoint-dir": "--workdir",
    "--layout": "--layout",
    "--collective-timeout-s": "--collective-timeout-s",
    "--preflight": "--no-preflight",
    "--no-preflight": "--no-preflight",
}


def _with_trainer_args(reference: dict, argv: list[str], extra: tuple[str, ...]) -> dict:
    """The reference trainer's model and batch once ``extra`` (its own flags, after
    `--`) are applied, checked by its own parser (``trainer.check_args``, in a process
    of its own); raises ValueError naming the fix."""
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_TRAINER_FLAGS:
            raise ValueError(
                f"{flag} after --: keel up sets it; give keel up "
                f"{OWNED_TRAINER_FLAGS[flag]} instead"
            )
    checked = subprocess.run(
        [sys.executable, "-m", "trainer.check_args", *argv, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("KEEL_")},
    )
    if checked.returncode != 0:
        problem = checked.stderr.strip().splitlines()[-1:] or ["invalid arguments"]
        raise ValueError(
            f"the reference trainer's arguments after --: "
            f"{problem[0].partition('error: ')[2] or problem[0]}"
        )
    resolved = json.loads(checked.stdout)
    return {key: resolved[key] for key in reference}


def _check_cluster_can_fire(schedule: keel_pb2.FaultSchedule, options: UpOptions) -> None:
    """Refuse faults that this cluster and job could never fire, or not survive as
    the fault intends; raises ValueError naming the fix."""
    faults = list(schedule.faults)
    if not options.script:
        late = [f for f in faults if f.step > options.steps]
        if late:
            raise ValueError(
                f"{kind_of(late[0]).value} at step {late[0].step} would never fire: the "
                f"job runs --steps {options.steps}"
            )
    if options.etcd_endpoints and any(kind_of(f) is FaultKind.RESTART_ETCD for f in faults):
        raise ValueError(
            "restart_etcd restarts the embedded etcd; drop --etcd-endpoints "
            "(and unset KEEL_ETCD_ENDPOINTS)"
        )
    leader_kills = sum(
        1 for f in faults if kind_of(f) in (FaultKind.KILL_LEADER, FaultKind.TERM_LEADER)
    )
    if leader_kills >= options.controllers:
        raise ValueError(
            f"{leader_kills} kill_leader/term_leader fault(s) need as many "
            f"standbys: give --controllers {leader_kills + 1}"
        )
    lost = [f.node for f in faults if kind_of(f) in (FaultKind.LOSE_NODE, FaultKind.TERM_AGENT)]
    twice = sorted({n for n in lost if lost.count(n) > 1})
    if twice:
        raise ValueError(
            f"node {twice[0]} is lost twice; lose_node and term_agent end its agent for good"
        )
    touched = [
        f
        for f in faults
        if kind_of(f)
        in (
            FaultKind.KILL_AGENT,
            FaultKind.STALL_AGENT,
            FaultKind.STALL_NODE,
            FaultKind.PARTITION_NODE,
        )
        and f.node in set(lost)
    ]
    if touched:
        raise ValueError(
            f"node {touched[0].node} is lost by lose_node or term_agent; "
            f"{kind_of(touched[0]).value} cannot also act on it"
        )
