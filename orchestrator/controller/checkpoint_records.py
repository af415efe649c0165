"""A job's checkpoint records in etcd: recording the commits agents report (and the
newest memory snapshot), telling the job's nodes the newest (their ranks' retention
keeps it), pruning old records, and the problems ranks report (refused stale commits,
quarantined checkpoints, failed saves, nodes they point at). Part of the executor:
called with the state lock held, from the reconcile thread."""

from __future__ import annotations

import structlog

from common.records import newest_good
from common.wire_kinds import WIRE_PROBLEM_KINDS, CheckpointProblemKind
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.controller.state import ControllerState
from orchestrator.controller.store import Deposed
from orchestrator.policy import memory_snapshots
from orchestrator.policy.event_kind import EventKind
from orchestrator.policy.offenders import checkpoint_suspect
from orchestrator.policy.retention import records_to_prune
from protos import keel_pb2

log = structlog.get_logger()


class CheckpointRecords:
    def __init__(self, state: ControllerState):
        self.state = state
        self.store = state.store

    def record(self, job: JobRuntime) -> None:
        """Commit queued checkpoints in etcd; what etcd does not take stays queued and
        the next tick tries again. Not recorded means not committed: until then the
        restore point stays the previous one."""
        for record in list(job.unrecorded):
            if not _stored("checkpoint", job, record.step, self.store.record_checkpoint, record):
                continue
            job.unrecorded.remove(record)
            job.goodput.settle(record.step)
            if job.last_checkpoint and job.last_checkpoint.step >= record.step:
                continue  # a late retry of an older one
            job.last_checkpoint = record
            log.info(
                "checkpoint committed",
                job=job.name,
                generation=record.generation,
                step=record.step,
                path=record.path,
            )
            self.announce(job)
            self.prune(job)

    def record_memory_snapshot(self, job: JobRuntime) -> None:
        """Record the newest memory snapshot reported (one etcd write, however many
        were reported since the last tick); what etcd does not take is tried again
        next tick, unless a newer one replaces it."""
        record = job.unrecorded_memory_snapshot
        if record is None:
            return
        held = job.last_memory_snapshot
        if not memory_snapshots.supersedes(
            held, record.generation, record.step, record.replica_step, record.replica_node
        ):
            job.unrecorded_memory_snapshot = None  # older than what etcd holds (a rebuild)
            return
        if not _stored("memory snapshot", job, record.step, self.store.put_memory_snapshot, record):
            return
        if job.unrecorded_memory_snapshot is record:
            job.unrecorded_memory_snapshot = None
        job.last_memory_snapshot = record

    def announce(self, job: JobRuntime) -> None:
        """Tell the job's nodes the newest recorded checkpoint: their ranks' retention
        keeps it."""
        if not job.last_checkpoint:
            return
        for node in job.nodes:
            self.state.send(
                node,
                keel_pb2.ControllerMessage(
                    checkpoint_recorded=keel_pb2.CheckpointRecorded(
                        job=job.name, generation=job.generation, step=job.last_checkpoint.step
                    )
                ),
            )

    def prune(self, job: JobRuntime) -> None:
        """Delete the records ``policy.retention.records_to_prune`` names: all but the
        newest, sparing the restore point in use and its fallbacks."""
        records = self.store.checkpoints(job.name)
        in_use = {*job.restore_fallbacks, job.restore_from} - {""}
        doomed = records_to_prune(records, in_use)
        if doomed:
            self.store.delete_checkpoints(job.name, doomed)
            log.info(
                "checkpoint records pruned",
                job=job.name,
                deleted=len(doomed),
                kept=len(records) - len(doomed),
            )
        job.records_pruned = True

    def problems(self, job: JobRuntime) -> None:
        """Checkpoints ranks would not use or could not save: an event each, counted
        by kind (``keel_checkpoint_problems_total``); a quarantined one is marked in its
        record, and is never a restore point again (only proven damage quarantines); a
        node a problem points at (``offenders.checkpoint_suspect``) is suspected, and
        the next generation stays off it."""
        while job.checkpoint_problems:
            reporter, problem = job.checkpoint_problems[0]
            kind = WIRE_PROBLEM_KINDS.from_wire(problem.kind)
            suspect = checkpoint_suspect(kind, reporter, problem)
            if kind is CheckpointProblemKind.QUARANTINED:
                records = {r.step: r for r in self.store.checkpoints(job.name)}
                record = records.get(problem.step)
                if record is not None and record.path != problem.path:
                    record = None  # not the checkpoint etcd records for that step
                if record is not None and not record.quarantined:
                    record = record.replace(quarantined=True, quarantine_reason=problem.reason)
                    self.store.update_checkpoint(job.name, record)
                    records[problem.step] = record
                job.last_checkpoint = newest_good([records[s] for s in sorted(records)])
                job.health.event(
                    EventKind.QUARANTINED,
                    f"checkpoint of step {problem.step} failed "
                    f"verification and was set aside: "
                    f"{problem.reason}",
                    step=problem.step,
                )
            elif kind is CheckpointProblemKind.FOREIGN_LINEAGE:
                # Nothing of the job may be written there, on any node: it cannot go on.
                job.fatal = problem.reason
                job.health.event(EventKind.ALERT, problem.reason)
            elif suspect is not None:
                job.health.suspected[suspect.node] = suspect.reason
                job.health.event(
                    EventKind.SUSPECTED, suspect.reason, node=suspect.node, step=problem.step
                )
            elif kind is CheckpointProblemKind.SAVE_FAILED:
                # Nothing to mark: a failed save left no checkpoint, and the restore
                # point stays the newest recorded one.
                job.health.event(
                    EventKind.CHECKPOINT_FAILED,
                    f"generation {problem.generation}'s checkpoint of step {problem.step} "
                    f"was not saved; training went on: {problem.reason}",
                    step=problem.step,
                )
            else:
                job.health.event(
                    EventKind.CHECKPOINT_REFUSED,
                    f"generation {problem.generation}'s "
                    f"commit of step {problem.step} was "
                    f"refused: {problem.reason}",
                    step=problem.step,
                )
            job.checkpoint_problem_counts[kind.value] = (
                job.checkpoint_problem_counts.get(kind.value, 0) + 1
            )
            job.checkpoint_problems.pop(0)


def _stored(what: str, job: JobRuntime, step: int, write, record) -> bool:
    """Whether etcd took ``write(job.name, record)`` (``what`` of step ``step``); one it
    did not take is logged, for the next tick to try again. Deposed: raised (no longer
    leading)."""
    try:
        write(job.name, record)
    except Deposed:
        raise
    except Exception as exc:
        log.warning(f"could not record {what}; will retry", job=job.name, step=step, error=str(exc))
        return False
    return True
