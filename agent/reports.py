"""What the agent knows of its ranks' progress and tells the controller: step reports
(from the ranks over the local socket, batched up to the flush period), each rank's
latest report (progress for the hang detector, and replayed after every Hello so a
controller that took over knows the step and loss), and the exits and newest commits
(durable and memory) of the current generation (replayed after every Hello too; the
controller treats both as idempotent). The ranks' threads and the agent's main loop
share it; one lock guards it.
"""

from __future__ import annotations

import collections
import threading
import time

from common.steps import MAX_BATCH_REPORTS, summarize
from protos import keel_pb2

STEP_TIMES_KEPT = 64  # recent step times the hang timeout scales with
# Step reports sent in one message at most, however long the controller asks batches
# to be (a fast job on a large cluster): a message of these is about 250 KB.
FULL_BATCH = 4096


class Reports:
    def __init__(self):
        self._lock = threading.Lock()
        self._generation: tuple[str, int] | None = None  # (job, generation) reported on
        self._pending: list[keel_pb2.StepReport] = []
        # rank -> (when it arrived, monotonic; its latest report), in step order
        self._latest: dict[int, tuple[float, keel_pb2.StepReport]] = {}
        self._step_times: collections.deque = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._checkpoint_wanted: int | None = None  # a save after this step is wanted
        self._recorded_step = 0
        self._replay: list[keel_pb2.AgentMessage] = []

    def begin(self, job: str, generation: int) -> None:
        """A new generation runs here: what was known of the last one goes."""
        with self._lock:
            self._generation = (job, generation)
            self._pending.clear()
            self._latest.clear()
            self._step_times.clear()
            self._checkpoint_wanted = None
            self._replay = []

    def recorded(self, generation: int, step: int) -> None:
        """The controller recorded the checkpoint of ``step``: the ranks learn it in their
        next acks (so that retention keeps it)."""
        with self._lock:
            if self._generation is not None and self._generation[1] == generation:
                self._recorded_step = max(self._recorded_step, step)

    def recorded_step(self) -> int:
        with self._lock:
            return self._recorded_step

    def end(self) -> None:
        """The generation stopped here: reports still arriving for it are dropped."""
        with self._lock:
            self._generation = None

    def full(self) -> bool:
        """Whether a batch's worth of step reports is waiting: send it now."""
        return len(self._pending) >= FULL_BATCH  # (a length read needs no lock)

    # ------------------------------------------------------------ from the ranks
    def add_steps(self, generation: int, reports: list[keel_pb2.StepReport]) -> int | None:
        """Queue ranks' reports for the controller and note progress; return the
        controller's checkpoint request to pass on, as the step a save must come after
        (once: the trainers agree among themselves on the step), or None."""
        now = time.monotonic()
        with self._lock:
            if self._generation is None or generation != self._generation[1]:
                return None  # a straggling report from a generation that is gone
            self._pending.extend(reports)
            for report in reports:
                self._latest[report.rank] = (now, report)
                if report.step_time_s > 0:
                    self._step_times.append(report.step_time_s)
            wanted, self._checkpoint_wanted = self._checkpoint_wanted, None
            return wanted

    def want_checkpoint(self, generation: int, after_step: int) -> bool:
        """The controller asked generation ``generation`` for a checkpoint of a step
        after ``after_step``: the next step-report ack passes it on. False if that
        generation does not run here."""
        with self._lock:
            if self._generation is None or self._generation[1] != generation:
                return False
            self._checkpoint_wanted = max(
                after_step, -1 if self._checkpoint_wanted is None else self._checkpoint_wanted
            )
            return True

    # -------------------------------------------------------- to the controller
    def take_batch(self) -> keel_pb2.StepReportBatch | None:
        """The oldest step reports queued since the last call (``MAX_BATCH_REPORTS`` at
        most), summed up per step (``summarize``), or None."""
        with self._lock:
            # The rest of a backlog (reports queued while the stream was down) goes in
            # the next batch: the controller refuses one larger than this.
            reports = self._pending[:MAX_BATCH_REPORTS]
            self._pending = self._pending[MAX_BATCH_REPORTS:]
            if not reports or self._generation is None:
                return None
            job, generation = self._generation
        return keel_pb2.StepReportBatch(
            job=job, generation=generation, node_steps=summarize(reports)
        )

    def last_steps(self) -> dict[int, int]:
        """Each rank's latest reported step."""
        with self._lock:
            return {rank: report.step for rank, (_, report) in self._latest.items()}

    def progress(self) -> tuple[dict[int, tuple[float, keel_pb2.StepReport]], list[float]]:
        """Each rank's latest report with when it arrived, and the recent step times."""
        with self._lock:
            return dict(self._latest), list(self._step_times)

    def remember(self, message: keel_pb2.AgentMessage) -> None:
        """A rank exit, a checkpoint commit, a memory snapshot's or its copy's on the
        partner, to replay after every Hello; only the newest commit of each kind is
        kept (an older one changes nothing at the controller), a snapshot's before its
        copy's (the controller keeps a copy with the snapshot it records)."""
        kind = _commit_kind(message)
        with self._lock:
            if kind:
                self._replay = [m for m in self._replay if _commit_kind(m) != kind]
            if kind == "memory_snapshot":
                copies = [m for m in self._replay if _commit_kind(m) == "memory_copy"]
                self._replay = [m for m in self._replay if m not in copies] + [message, *copies]
            else:
                self._replay.append(message)

    def replay(self) -> list[keel_pb2.AgentMessage]:
        """What to send again right after a Hello: each rank's latest step report,
        summed up per step (marked ``replayed``: progress only), then the exits and the
        newest commits."""
        with self._lock:
            messages = []
            if self._generation is not None and self._latest:
                job, generation = self._generation
                latest = [report for _, report in self._latest.values()]
                messages.append(
                    keel_pb2.AgentMessage(
                        steps=keel_pb2.StepReportBatch(
                            job=job,
                            generation=generation,
                            node_steps=summarize(latest),
                            replayed=True,
                        )
                    )
                )
            return messages + list(self._replay)


def _commit_kind(message: keel_pb2.AgentMessage) -> str:
    """Which commit ``message`` reports, of which only the newest is replayed ("": not
    a commit)."""
    kind = message.WhichOneof("kind")
    if kind == "memory_snapshot_saved":
        return "memory_copy" if message.memory_snapshot_saved.replicated_to else "memory_snapshot"
    return "checkpoint" if kind == "checkpoint_saved" else ""
