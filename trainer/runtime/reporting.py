"""Reports to the node agent: step reports batched from a background thread, and the
agent's checkpoint requests (and requests to leave the generation) in their acks;
checkpoint and preflight reports sent directly. Reporting never blocks or fails a
training step; an unreachable agent costs one line on stderr. For restart in place,
``park`` and ``next_generation`` (``agent.parking`` is the agent's side).
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from common import env
from common.wire_kinds import (
    WIRE_COLLECTIVES,
    WIRE_PROBLEM_KINDS,
    CheckpointProblemKind,
    Collective,
)
from protos import keel_pb2, keel_pb2_grpc

STEP_REPORT_DEADLINE_S = 2.0
CHECKPOINT_REPORT_DEADLINE_S = 5.0
PREFLIGHT_REPORT_DEADLINE_S = 5.0
# Attaching waits for the agent's socket this long; a rank that cannot attach is
# watched from its first step report only.
ATTACH_DEADLINE_S = 30.0
# Batches go out at least this often so the agent's hang detector, which measures the
# age of the latest report, sees progress within a fraction of a second.
REPORT_INTERVAL_S = 0.25
REPORT_BATCH_SIZE = 32
# Beyond this many unsent reports (agent stuck, not just gone) new ones are dropped
# rather than growing memory for the rest of the run.
MAX_PENDING_REPORTS = 4096
# A flush waits for at most one in-flight ReportSteps call plus scheduling slack.
FLUSH_WAIT_S = STEP_REPORT_DEADLINE_S + 0.5
# With no step to report (a long first step, a slow checkpoint) the agent is still
# asked this often whether it answers: an empty report is the ping.
PING_S = 1.0
# A rank that fenced itself with SIGTERM and still runs this long after is SIGKILLed.
FENCE_KILL_AFTER_S = 5.0
PARK_DEADLINE_S = 10.0
# Each NextGeneration call; the agent holds it open for about a second.
NEXT_GENERATION_DEADLINE_S = 5.0
# A parked rank whose agent answers nothing this long (when there is no collective
# timeout to go by) stops waiting and exits.
PARKED_FENCE_S = 60.0

# gRPC's default reconnect back-off grows to two minutes; an agent that restarts (or
# starts listening after its ranks) should see reports again within seconds.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class _StepReporter:
    """Sends queued step reports from a daemon thread, in batches of up to
    ``REPORT_BATCH_SIZE`` at least every ``REPORT_INTERVAL_S`` seconds; a report flagged
    ``checkpointing`` goes out at once, so the agent knows of the save before it starts.
    Sets ``checkpoint_requested`` when an ack carries ``checkpoint_now``.

    Queuing a report is an append to a deque: the thread is woken only when a batch
    is full or a report is urgent, not per step, because waking it each step (a
    ``queue.Queue`` put) costs the training loop a thread switch each step."""

    _STOP = object()

    def __init__(
        self,
        stub: keel_pb2_grpc.AgentLocalStub,
        generation: int,
        log,
        on_ack: Callable[[keel_pb2.LocalAck], None],
        fence_after_s: float | None = None,
    ) -> None:
        """``on_ack`` takes every ack; ``fence_after_s``: stop this rank when the agent
        has answered nothing for this long (None: never)."""
        self._stub = stub
        self._generation = generation
        self._log = log
        self._on_ack = on_ack
        self._fence_after_s = fence_after_s
        self._answered_at = self._sent_at = time.monotonic()
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
                self._log(
                    f"{MAX_PENDING_REPORTS} step reports unsent; "
                    "dropping new ones until the agent catches up"
                )
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
        # While the agent fails, each call would wait out its deadline: reports are
        # dropped and only the ping goes, so the fence is checked every few seconds.
        while True:
            self._wake.wait(REPORT_INTERVAL_S)
            # Whatever is appended after this clear wakes the next wait; whatever was
            # appended before it is drained below.
            self._wake.clear()
            batch: list[keel_pb2.StepReport] = []
            while self._pending:
                item = self._pending.popleft()
                if isinstance(item, keel_pb2.StepReport):
                    if self._agent_failing:
                        continue  # dropped, as logged; the ping below finds out when it is back
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
            self._send(batch, ping=time.monotonic() - self._sent_at >= PING_S)
            self._check_fence()

    def _send(self, batch: list[keel_pb2.StepReport], ping: bool = False) -> None:
        if not batch and not ping:
            return
        self._sent_at = time.monotonic()
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
        self._answered_at = time.monotonic()
        if self._agent_failing:
            self._log("agent answers step reports again")
            self._agent_failing = False
        self._on_ack(ack)

    def _check_fence(self) -> None:
        """Self-fencing: a rank whose agent has answered nothing for the collective
        timeout is no longer supervised (the agent stalled or is cut off, and its node
        may count as lost), so it stops itself: SIGTERM, then SIGKILL."""
        silent_s = time.monotonic() - self._answered_at
        if self._fence_after_s is None or silent_s < self._fence_after_s:
            return
        self._log(
            f"the agent has answered nothing for {silent_s:.1f} s (the collective timeout "
            f"is {self._fence_after_s:g} s): stopping this rank"
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(FENCE_KILL_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _Credential(grpc.UnaryUnaryClientInterceptor):
    """Sends the rank's token with every call to its agent."""

    def __init__(self, token: str):
        self._metadata = ((env.RANK_TOKEN_METADATA, token),)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(
            _CallDetails(
                details.method,
                details.timeout,
                [*(details.metadata or ()), *self._metadata],
                details.credentials,
                details.wait_for_ready,
                details.compression,
            ),
            request,
        )


class AgentReporter:
    """This rank's connection to its node agent (the ``AgentLocal`` service on the Unix
    socket ``agent_socket``). Creating the channel does not connect; the first call
    does, from the reporter thread, so a missing agent never delays training."""

    def __init__(
        self,
        agent_socket: str,
        *,
        rank: int,
        world_size: int,
        generation: int,
        job: str,
        log: Callable[[str], None],
        fence_after_s: float | None = None,
        token: str = "",
        restart_in_place: bool = False,
    ) -> None:
        """``token``: the rank's credential (``KEEL_RANK_TOKEN``), sent with every call;
        ``restart_in_place``: said when attaching (this rank can ``park``)."""
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.job = job
        self.log = log
        self.restart_in_place = restart_in_place
        self.fence_after_s = fence_after_s
        # The pending checkpoint request: a save of a step after this one meets it
        # (None: none pending); and the newest step this rank reported saving after.
        self._checkpoint_lock = threading.Lock()
        self._checkpoint_after: int | None = None
        self._saving_step = -1
        self._memory_report_failing = False
        self._leave_requested = threading.Event()
        self._channel = grpc.insecure_channel(f"unix:{agent_socket}", options=_CHANNEL_OPTIONS)
        self._stub = keel_pb2_grpc.AgentLocalStub(
            grpc.intercept_channel(self._channel, _Credential(token))
        )
        self.recorded_step = 0  # the newest checkpoint the controller recorded, as last heard
        self._reporter = _StepReporter(self._stub, generation, log, self._take_ack, fence_after_s)
        threading.Thread(target=self._attach, name="keel-attach", daemon=True).start()

    def _attach(self) -> None:
        """Tell the agent this rank reports its steps, so that it is watched for a hang
        before its first one too (a rank that never says so is not)."""
        try:
            self._take_ack(
                self._stub.Attach(
                    keel_pb2.RankAttach(
                        generation=self.generation,
                        rank=self.rank,
                        restart_in_place=self.restart_in_place,
                    ),
                    timeout=ATTACH_DEADLINE_S,
                    wait_for_ready=True,
                )
            )
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:  # closed: the rank is ending
                self.log(
                    f"cannot attach to the agent ({exc.code().name}: {exc.details()}); "
                    f"it will watch this rank from its first step report"
                )

    def _take_ack(self, ack: keel_pb2.LocalAck) -> None:
        if ack.checkpoint_now:
            with self._checkpoint_lock:
                # A save after the later of two requests meets both.
                self._checkpoint_after = max(
                    ack.checkpoint_after_step,
                    -1 if self._checkpoint_after is None else self._checkpoint_after,
                )
        if ack.leave_generation:
            self._leave_requested.set()
        self.recorded_step = max(self.recorded_step, ack.recorded_step)

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
        restore_s: float = 0.0,
    ) -> None:
        """Queues the report of finished step ``step`` and returns at once (the
        arguments are ``Runtime.report_step``'s)."""
        if checkpointing:
            with self._checkpoint_lock:
                self._saving_step = max(self._saving_step, step)
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
                restore_s=restore_s,
            )
        )

    def take_checkpoint_request(self) -> bool:
        """Whether the agent asked for a checkpoint (``checkpoint_now`` in a step-report
        ack) since the last call that no save this rank reported (``checkpointing``) has
        met yet; the request is cleared. Only this rank's own agent connection is seen,
        so fold the answer into a collective before acting on it.

        The controller asks every node at once and each hears it at its own step: the
        ranks of the node that heard it first have all ranks save (the answers are
        folded), and a rank that hears it a step later must not have them save again."""
        with self._checkpoint_lock:
            after, self._checkpoint_after = self._checkpoint_after, None
            return after is not None and self._saving_step <= after

    def leave_requested(self) -> bool:
        """Whether the agent asked this rank to leave its generation (it is being
        stopped); stays set."""
        return self._leave_requested.is_set()

    def park(self, failed: bool, reason: str, tearing_down: bool = False) -> str | None:
        """Tells the agent this rank left its generation alive (``failed``: on an error,
        ``reason``, not because it was asked); with ``tearing_down``, that it is on its
        way to (it parks with a second call). Parking sends pending step reports first
        and stops the reporter. None if the agent keeps it, else why not."""
        if not tearing_down:
            self._reporter.close()
        try:
            self._stub.Park(
                keel_pb2.RankPark(
                    generation=self.generation,
                    rank=self.rank,
                    failed=failed,
                    reason=reason[-8000:],
                    tearing_down=tearing_down,
                ),
                timeout=PARK_DEADLINE_S,
            )
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return None

    def next_generation(self) -> keel_pb2.NextGenerationAnswer:
        """Asks the agent, until it says, what this parked rank becomes: "start" (with
        the new rank's environment and files) or "exit". An agent that answers nothing
        for the collective timeout (else ``PARKED_FENCE_S``) counts as "exit"."""
        fence_s = self.fence_after_s or PARKED_FENCE_S
        answered_at = time.monotonic()
        while True:
            try:
                answer = self._stub.NextGeneration(
                    keel_pb2.NextGenerationRequest(), timeout=NEXT_GENERATION_DEADLINE_S
                )
            except grpc.RpcError as error:
                if error.code() is grpc.StatusCode.UNAUTHENTICATED:
                    return keel_pb2.NextGenerationAnswer(
                        action=keel_pb2.NEXT_GENERATION_ACTION_EXIT, reason=error.details()
                    )
                if time.monotonic() - answered_at >= fence_s:
                    return keel_pb2.NextGenerationAnswer(
                        action=keel_pb2.NEXT_GENERATION_ACTION_EXIT,
                        reason=f"the agent has answered nothing for {fence_s:g} s "
                        f"({error.code().name}: {error.details()})",
                    )
                time.sleep(0.2)
                continue
            answered_at = time.monotonic()
            if answer.action != keel_pb2.NEXT_GENERATION_ACTION_WAIT:
                return answer

    def report_preflight(self, results: Sequence, wall_s: float) -> bool:
        """Sends this rank's preflight sweep to the agent: ``results`` are objects with
        the fields of ``CollectiveResult`` (``trainer.preflight.Result``), ``wall_s`` the
        sweep's wall time in seconds. Blocks for at most ``PREFLIGHT_REPORT_DEADLINE_S``
        seconds; returns whether the agent acknowledged. Failures are logged, never
        raised."""
        report = keel_pb2.PreflightReport(
            job=self.job,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            results=[
                keel_pb2.CollectiveResult(
                    collective=WIRE_COLLECTIVES.to_wire(Collective(result.collective)),
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

    def report_checkpoint(
        self, step: int, path: str, samples: int, *, save_s: float = 0.0, size: int = 0
    ) -> bool:
        """Tells the agent that the checkpoint of step ``step`` is durable at ``path``
        (``samples``: global data position after that step). Sends pending step reports
        first, then blocks for at most ``CHECKPOINT_REPORT_DEADLINE_S`` seconds. Returns
        whether the agent acknowledged; failures are logged, never raised, because the
        agent and controller decide what counts as committed."""
        self._reporter.flush()
        saved = keel_pb2.CheckpointSaved(
            job=self.job,
            generation=self.generation,
            step=step,
            path=path,
            samples=samples,
            save_s=save_s,
            bytes=size,
        )
        return self._commit_reported(
            self._stub.ReportCheckpoint,
            saved,
            lambda why: self.log(f"cannot report checkpoint step={step} path={path} ({why})"),
        )

    def _commit_reported(self, method, message, failed: Callable[[str], None]) -> bool:
        """``method(message)``, a commit's report, within ``CHECKPOINT_REPORT_DEADLINE_S``;
        whether the agent acknowledged (its ack taken), else ``failed(why)``."""
        try:
            ack = method(message, timeout=CHECKPOINT_REPORT_DEADLINE_S)
        except grpc.RpcError as error:
            failed(f"{error.code().name}: {error.details()}")
            return False
        self._take_ack(ack)
        return True

    def report_memory_snapshot(
        self, step: int, samples: int, *, size: int = 0, save_s: float = 0.0
    ) -> bool:
        """Tells the agent that the memory snapshot of step ``step`` is committed on
        every node (``samples``: global data position after it; ``size``: the tensor
        bytes of every rank's shards; ``save_s``: from its start to its commit). Blocks
        for at most ``CHECKPOINT_REPORT_DEADLINE_S`` seconds; whether the agent
        acknowledged (a failure is logged once until one is acknowledged again: the
        next snapshot's report tells the controller as much)."""
        saved = keel_pb2.MemorySnapshotSaved(
            job=self.job,
            generation=self.generation,
            step=step,
            samples=samples,
            bytes=size,
            save_s=save_s,
        )

        def failed(why: str) -> None:
            if not self._memory_report_failing:
                self.log(
                    f"cannot report the memory snapshot of step {step} ({why}); "
                    "not said again until one is"
                )
            self._memory_report_failing = True

        reported = self._commit_reported(self._stub.ReportMemorySnapshot, saved, failed)
        if reported:
            self._memory_report_failing = False
        return reported

    def report_checkpoint_problem(
        self, step: int, path: str, kind: str, reason: str, *, suspect_node: str = ""
    ) -> bool:
        """Tells the agent of a checkpoint this rank would not or could not use or save
        (``kind``: a ``CheckpointProblemKind``, or its string; ``suspect_node``: the
        node it points at, "" for none); whether it acknowledged."""
        try:
            self._stub.ReportCheckpointProblem(
                keel_pb2.CheckpointProblem(
                    job=self.job,
                    generation=self.generation,
                    step=step,
                    path=path,
                    kind=WIRE_PROBLEM_KINDS.to_wire(CheckpointProblemKind(kind)),
                    reason=reason,
                    suspect_node=suspect_node,
                ),
                timeout=CHECKPOINT_REPORT_DEADLINE_S,
            )
        except grpc.RpcError as error:
            self.log(
                f"cannot report the {kind} checkpoint step={step} ({error.code().name}: "
                f"{error.details()})"
            )
            return False
        return True

    def flush(self) -> bool:
        """Waits until every step report queued so far was sent (or dropped); False if
        that took longer than ``FLUSH_WAIT_S``."""
        return self._reporter.flush()

    def close(self) -> None:
        """Sends pending step reports (waiting at most ``FLUSH_WAIT_S`` seconds) and
        closes the channel."""
        self._reporter.close()
        self._channel.close()
