"""The library a training script uses to live under Keel: the rank's identity from its
environment, step, checkpoint and preflight reports to the node agent, the agent's
checkpoint requests, stack dumps on SIGUSR1 and scripted fault injection.

Everything degrades to a no-op under plain ``torchrun``: without ``KEEL_AGENT_SOCKET``
nothing is sent, without ``KEEL_FAULTS`` nothing is injected. Reporting never blocks or
fails a training step; an unreachable agent costs one line on stderr.

Steps are numbered from 1: step N is the N-th optimizer step of the job, a fault at
step N fires when step N starts, and a report for step N is sent after it finished.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import grpc
from google.protobuf import json_format

from common.layout import AXES, MESH_DIM_NAMES, Layout, LayoutError, parse_axes
from protos import keel_pb2, keel_pb2_grpc

__all__ = ["MESH_DIM_NAMES", "Layout", "LayoutError", "Runtime", "init", "parse_mesh"]

STEP_REPORT_DEADLINE_S = 2.0
CHECKPOINT_REPORT_DEADLINE_S = 5.0
PREFLIGHT_REPORT_DEADLINE_S = 5.0
# Batches go out at least this often so the agent's hang detector, which measures the
# age of the latest report, sees progress within a fraction of a second.
REPORT_INTERVAL_S = 0.25
REPORT_BATCH_SIZE = 32
# Beyond this many unsent reports (agent stuck, not just gone) new ones are dropped
# rather than growing memory for the rest of the run.
MAX_PENDING_REPORTS = 4096
# A flush waits for at most one in-flight ReportSteps call plus scheduling slack.
FLUSH_WAIT_S = STEP_REPORT_DEADLINE_S + 0.5

MESH_DIMENSIONS = AXES
RANK_FAULT_KINDS = ("crash", "kill", "hang", "slow")
# A restarted generation replays the steps after its checkpoint; these must not fire
# again there, or a crash at step 7 would crash every generation forever.
ONE_SHOT_FAULT_KINDS = ("crash", "kill", "hang")

# gRPC's default reconnect back-off grows to two minutes; an agent that restarts (or
# starts listening after its ranks) should see reports again within seconds.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def parse_mesh(text: str | None, world_size: int, source: str = "KEEL_MESH") -> dict[str, int]:
    """Parses ``KEEL_MESH`` ("dp_shard=4" or "dp_replicate=2,dp_shard=2,tp=1") into
    dimension → size, in the order given. Unset or empty means ``dp_shard`` over all
    ranks. The sizes must multiply to ``world_size``. ``source`` names where the text
    came from (``KEEL_MESH``, ``--layout``) in error messages."""
    return parse_axes(text, world_size, source)


def parse_fault_schedule(text: str | None) -> keel_pb2.FaultSchedule:
    """Parses ``KEEL_FAULTS`` (a ``FaultSchedule`` as protobuf JSON) and checks the rank
    faults in it. Unset or empty means no faults."""
    schedule = keel_pb2.FaultSchedule()
    if not text:
        return schedule
    json_format.Parse(text, schedule)
    for index, fault in enumerate(schedule.faults):
        if fault.kind == "slow" and fault.factor < 1.0:
            raise ValueError(
                f"KEEL_FAULTS fault #{index} is slow with factor {fault.factor}; "
                f"give a step-time multiplier of at least 1, e.g. factor 3"
            )
    return schedule


def rank_faults(schedule: keel_pb2.FaultSchedule, rank: int) -> list[tuple[int, keel_pb2.Fault]]:
    """The faults this rank applies itself, as ``(index in schedule, fault)``: kinds in
    ``RANK_FAULT_KINDS`` whose ``rank`` is set and equals ``rank``. Other kinds (such as
    ``lose_node``) belong to the orchestrator and are left alone."""
    return [
        (index, fault)
        for index, fault in enumerate(schedule.faults)
        if fault.kind in RANK_FAULT_KINDS and fault.HasField("rank") and fault.rank == rank
    ]


def fault_marker_path(checkpoint_dir: str, index: int) -> str:
    """Where the one-shot marker of schedule entry ``index`` lives."""
    return os.path.join(checkpoint_dir, ".faults", str(index))


def claim_fault(checkpoint_dir: str | None, index: int, note: str) -> bool:
    """Claims the right to fire one-shot fault ``index``: True exactly once per
    checkpoint directory, across processes and generations (the marker is created with
    O_EXCL). Without a checkpoint directory there is nothing to remember it in, so the
    fault always fires. ``note`` is written into the marker for whoever reads it later."""
    if not checkpoint_dir:
        return True
    path = fault_marker_path(checkpoint_dir, index)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as marker:
        marker.write(note + "\n")
    return True


class _StepReporter:
    """Sends queued step reports from a daemon thread, in batches of up to
    ``REPORT_BATCH_SIZE`` at least every ``REPORT_INTERVAL_S`` seconds; a report flagged
    ``checkpointing`` goes out at once, so the agent knows of the save before it starts.
    Sets ``checkpoint_requested`` when an ack carries ``checkpoint_now``.

    Queuing a report is an append to a deque: the thread is woken only when a batch
    is full or a report is urgent, not per step, because waking it each step (a
    ``queue.Queue`` put) costs the training loop tens of microseconds of thread
    switching."""

    _STOP = object()

    def __init__(self, stub: keel_pb2_grpc.AgentLocalStub, generation: int, log,
                 checkpoint_requested: threading.Event) -> None:
        self._stub = stub
        self._generation = generation
        self._log = log
        self._checkpoint_requested = checkpoint_requested
        # Step reports, and flush and stop markers; appends and pops are atomic.
        self._pending: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._agent_failing = False
        self._dropping = False
        self._thread = threading.Thread(target=self._run, name="keel-step-reporter", daemon=True)
        self._thread.start()

    def put(self, report: keel_pb2.StepReport) -> None:
        if len(self._pending) >= MAX_PENDING_REPORTS:
            if not self._dropping:
                self._log(f"{MAX_PENDING_REPORTS} step reports unsent; dropping new ones until the agent catches up")
                self._dropping = True
            return
        self._dropping = False
        self._pending.append(report)
        if report.checkpointing or len(self._pending) == REPORT_BATCH_SIZE:
            self._wake.set()

    def flush(self, timeout_s: float = FLUSH_WAIT_S) -> bool:
        """Waits until every report queued so far was sent (or dropped); False if that
        took longer than ``timeout_s``."""
        done = threading.Event()
        self._pending.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = FLUSH_WAIT_S) -> None:
        self._pending.append(self._STOP)
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(REPORT_INTERVAL_S)
            # Whatever is appended after this clear wakes the next wait; whatever was
            # appended before it is drained below.
            self._wake.clear()
            batch: list[keel_pb2.StepReport] = []
            while self._pending:
                item = self._pending.popleft()
                if isinstance(item, keel_pb2.StepReport):
                    batch.append(item)
                    if len(batch) == REPORT_BATCH_SIZE:
                        self._send(batch)
                        batch = []
                    continue
                self._send(batch)
                batch = []
                if item is self._STOP:
                    return
                item.set()
            self._send(batch)

    def _send(self, batch: list[keel_pb2.StepReport]) -> None:
        if not batch:
            return
        try:
            ack = self._stub.ReportSteps(
                keel_pb2.LocalStepReports(generation=self._generation, reports=batch),
                timeout=STEP_REPORT_DEADLINE_S,
            )
        except grpc.RpcError as error:
            if not self._agent_failing:
                self._log(
                    f"cannot report steps to the agent ({error.code().name}: {error.details()}); "
                    f"dropping step reports until it answers"
                )
                self._agent_failing = True
            return
        if self._agent_failing:
            self._log("agent answers step reports again")
            self._agent_failing = False
        if ack.checkpoint_now:
            self._checkpoint_requested.set()


class Runtime:
    """One rank's view of its job. Build it with ``init()``.

    Attributes: ``rank``, ``world_size``, ``local_rank`` (ints), ``generation`` (int, 0
    without Keel), ``job`` (str, "" without Keel), ``mesh`` (dimension → size),
    ``checkpoint_dir`` and ``restore_from`` (absolute paths or None), ``restart_count``
    (int), ``slow_factor`` (float, step-time multiplier from a ``slow`` fault, 1.0 if none).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        generation: int,
        job: str,
        mesh: dict[str, int],
        checkpoint_dir: str | None,
        restore_from: str | None,
        restart_count: int,
        agent_socket: str | None,
        faults: keel_pb2.FaultSchedule,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.generation = generation
        self.job = job
        self.mesh = mesh
        self.checkpoint_dir = checkpoint_dir
        self.restore_from = restore_from
        self.restart_count = restart_count
        self.agent_socket = agent_socket
        self.slow_factor = 1.0
        self._faults = rank_faults(faults, rank)
        self._channel: grpc.Channel | None = None
        self._stub: keel_pb2_grpc.AgentLocalStub | None = None
        self._reporter: _StepReporter | None = None
        self._checkpoint_requested = threading.Event()
        if agent_socket:
            # Creating a channel does not connect; the first RPC does, from the
            # reporter thread, so a missing agent never delays training.
            self._channel = grpc.insecure_channel(f"unix:{agent_socket}", options=_CHANNEL_OPTIONS)
            self._stub = keel_pb2_grpc.AgentLocalStub(self._channel)
            self._reporter = _StepReporter(self._stub, generation, self.log, self._checkpoint_requested)

    def log(self, message: str) -> None:
        """Writes one line to stderr, tagged with job, generation and rank."""
        print(
            f"keel.trainer job={self.job or '-'} generation={self.generation} rank={self.rank}: {message}",
            file=sys.stderr,
            flush=True,
        )

    def report_step(
        self,
        step: int,
        loss: float,
        tokens: int,
        step_time_s: float,
        *,
        data_s: float = 0.0,
        compute_s: float = 0.0,
        optimizer_s: float = 0.0,
        checkpoint_s: float = 0.0,
        checkpointing: bool = False,
    ) -> None:
        """Queues the report of finished step ``step`` for the agent and returns at once.
        ``tokens`` are the tokens this rank processed in the step; ``step_time_s`` is its
        own time for the step in seconds, before waiting on peers. The phases, in
        seconds: ``data_s`` (reading the batch), ``compute_s`` (forward and backward),
        ``optimizer_s``, and ``checkpoint_s``, the time the loop was blocked by a
        checkpoint since the previous report. ``checkpointing``: a checkpoint save
        follows this step; such a report is sent at once, so call this before the save.
        A no-op without an agent socket."""
        if self._reporter is None:
            return
        self._reporter.put(
            keel_pb2.StepReport(
                rank=self.rank,
                step=step,
                loss=loss,
                tokens=tokens,
                step_time_s=step_time_s,
                at=time.time(),
                data_s=data_s,
                compute_s=compute_s,
                optimizer_s=optimizer_s,
                checkpoint_s=checkpoint_s,
                checkpointing=checkpointing,
            )
        )

    def take_checkpoint_request(self) -> bool:
        """Whether the agent asked for a checkpoint (``checkpoint_now`` in a step-report
        ack) since the last call; the request is cleared. Only this rank's own agent
        connection is seen, so fold the answer into a collective before acting on it."""
        if not self._checkpoint_requested.is_set():
            return False
        self._checkpoint_requested.clear()
        return True

    def report_preflight(self, results: Sequence, wall_s: float) -> bool:
        """Sends this rank's preflight sweep to the agent: ``results`` are objects with
        the fields of ``CollectiveResult`` (``trainer.preflight.Result``), ``wall_s`` the
        sweep's wall time in seconds. Blocks for at most ``PREFLIGHT_REPORT_DEADLINE_S``
        seconds; returns whether the agent acknowledged. Failures are logged, never
        raised. A no-op (False) without an agent socket."""
        if self._stub is None:
            return False
        report = keel_pb2.PreflightReport(
            job=self.job,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            results=[
                keel_pb2.CollectiveResult(
                    collective=result.collective,
                    size_bytes=result.size_bytes,
                    time_s=result.time_s,
                    algbw_gbps=result.algbw_gbps,
                    busbw_gbps=result.busbw_gbps,
                )
                for result in results
            ],
            wall_s=wall_s,
        )
        try:
            self._stub.ReportPreflight(report, timeout=PREFLIGHT_REPORT_DEADLINE_S)
        except grpc.RpcError as error:
            self.log(f"cannot report preflight ({error.code().name}: {error.details()})")
            return False
        return True

    def report_checkpoint(self, step: int, path: str, samples: int) -> bool:
        """Tells the agent that the checkpoint of step ``step`` is durable at ``path``
        (``samples``: global data position after that step). Sends pending step reports
        first, then blocks for at most ``CHECKPOINT_REPORT_DEADLINE_S`` seconds. Returns
        whether the agent acknowledged; failures are logged, never raised, because the
        agent and controller decide what counts as committed."""
        if self._stub is None:
            return False
        self._reporter.flush()
        try:
            self._stub.ReportCheckpoint(
                keel_pb2.CheckpointSaved(
                    job=self.job, generation=self.generation, step=step, path=path, samples=samples
                ),
                timeout=CHECKPOINT_REPORT_DEADLINE_S,
            )
        except grpc.RpcError as error:
            self.log(f"cannot report checkpoint step={step} path={path} ({error.code().name}: {error.details()})")
            return False
        return True

    def inject_faults(self, step: int) -> None:
        """Applies this rank's scheduled faults for step ``step``; call it when the step
        starts. ``crash`` raises RuntimeError, ``kill`` SIGKILLs this process, ``hang``
        sleeps forever, ``slow`` sets ``slow_factor`` for this and every later step
        (``after_step`` applies it). ``ONE_SHOT_FAULT_KINDS`` (crash, kill and hang)
        fire once per checkpoint directory, whatever the generation."""
        for index, fault in self._faults:
            if fault.step != step:
                continue
            if fault.kind in ONE_SHOT_FAULT_KINDS:
                note = f"{fault.kind} step={step} rank={self.rank} generation={self.generation} pid={os.getpid()}"
                if not claim_fault(self.checkpoint_dir, index, note):
                    continue
            if fault.kind == "slow":
                self.slow_factor = fault.factor
                self.log(f"injected slow-down x{fault.factor:g} from step {step} (fault #{index})")
                continue
            self.log(f"injecting {fault.kind} at step {step} (fault #{index})")
            if fault.kind == "crash":
                raise RuntimeError(f"injected crash at step {step} on rank {self.rank}")
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: alive, silent, until the agent kills us
                time.sleep(3600)

    def after_step(self, compute_s: float) -> float:
        """Sleeps to stretch a step that computed for ``compute_s`` seconds by
        ``slow_factor``; returns the seconds slept (0 unless a ``slow`` fault is active)."""
        delay_s = (self.slow_factor - 1.0) * compute_s
        if delay_s > 0:
            time.sleep(delay_s)
        return max(delay_s, 0.0)

    def close(self) -> None:
        """Sends pending step reports (waiting at most ``FLUSH_WAIT_S`` seconds) and
        closes the agent channel. Safe to call twice."""
        if self._reporter is not None:
            self._reporter.close()
            self._reporter = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; unset it or give a whole number") from None


def init(environ: Mapping[str, str] | None = None) -> Runtime:
    """Builds this rank's ``Runtime`` from ``environ`` (default ``os.environ``): the
    torchrun variables, ``KEEL_*`` when Keel started the rank. Installs a SIGUSR1
    handler that dumps every thread's Python stack to stderr, for hang diagnosis."""
    env = os.environ if environ is None else environ
    world_size = _int(env, "WORLD_SIZE", 1)
    runtime = Runtime(
        rank=_int(env, "RANK", 0),
        world_size=world_size,
        local_rank=_int(env, "LOCAL_RANK", 0),
        generation=_int(env, "KEEL_GENERATION", 0),
        job=env.get("KEEL_JOB", ""),
        mesh=parse_mesh(env.get("KEEL_MESH"), world_size),
        checkpoint_dir=env.get("KEEL_CHECKPOINT_DIR") or None,
        restore_from=env.get("KEEL_RESTORE_FROM") or None,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        agent_socket=env.get("KEEL_AGENT_SOCKET") or None,
        faults=parse_fault_schedule(env.get("KEEL_FAULTS")),
    )
    # The process's own fd 2, which the agent captures, even when sys.stderr has been
    # swapped for something without a file descriptor.
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    return runtime
