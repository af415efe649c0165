"""What a controller that takes over knows of each job: everything rebuilt from etcd
(spec, state, generation, restarts, plan, committed checkpoints, the job's first loss,
events, and the operator intents under way). The agents' replays tell it the rest."""

from __future__ import annotations

import uuid

import grpc
import structlog
from etcd3.exceptions import Etcd3Exception

from common import keys
from common.records import RecordError, newest_good
from orchestrator.controller.goodput import Goodput
from orchestrator.controller.job_runtime import Intents, JobRuntime, Progress
from orchestrator.controller.plans import adopt_plan
from orchestrator.controller.store import Store
from orchestrator.policy.operations import Operation

log = structlog.get_logger()


def load_jobs(store: Store, now: float) -> dict[str, JobRuntime]:
    """Every job in etcd. A job whose spec, state or plan does not parse, or whose
    records parse but cannot be brought back together (a plan its spec cannot hold), is
    left out, loudly (``store.set_aside``), and left in etcd as it is, rather than keep
    every controller from leading; etcd errors propagate (the campaign retries)."""
    jobs = {}
    for name in store.job_names():
        try:
            job = load_job(store, name, now)
        except (grpc.RpcError, Etcd3Exception):
            raise
        except RecordError as error:
            log.error(
                "cannot read the job's records in etcd; not managing it",
                job=name,
                key=error.key,
            )
            continue
        except Exception as exc:
            store.set_aside(RecordError(keys.job_state(name), f"{type(exc).__name__}: {exc}"))
            log.exception("cannot load the job from its records in etcd; not managing it", job=name)
            continue
        if job is not None:
            jobs[name] = job
    return jobs


def load_job(store: Store, name: str, now: float) -> JobRuntime | None:
    """Job ``name`` as etcd has it (None if its spec or state is missing); ``now`` is
    when it entered its state, as far as this controller knows."""
    spec_record = store.job_spec(name)
    read = store.job_state(name)
    if spec_record is None or read.value is None:
        return None
    spec, state = spec_record.spec, read.value
    if not spec_record.job_id:
        # Written before jobs had ids: the id it gets now is its lineage's from here on.
        spec_record = spec_record.replace(job_id=uuid.uuid4().hex)
        store.put_job_spec(name, spec_record)
    job = JobRuntime.new(
        spec,
        state.state,
        read.mod_revision,
        now,
        job_id=spec_record.job_id,
        generation=state.generation,
        restarts=state.restarts,
        reason=state.reason,
        failures=list(state.failures),
        intents=Intents(stop_requested=state.stop_requested, stop_now=state.stop_now),
        planned_stop=state.planned_stop,
        ended_at_unix=state.ended_at_unix,
        restarts_by_cause=dict(state.restarts_by_cause),
        checkpoint_problem_counts=dict(state.checkpoint_problems),
        state_seconds=dict(state.state_seconds),
        state_entered_at_unix=state.state_entered_at_unix,
        progress=Progress(tokens=state.tokens),
    )
    job.goodput = Goodput.from_record(state.goodput, job.health.spec.straggler_slowdown)
    records = store.checkpoints(name)
    plan = store.plan(name, job.generation) if job.generation else None
    if plan:
        adopt_plan(job, plan, records)
    job.last_checkpoint = newest_good(records)
    job.last_memory_snapshot = store.memory_snapshot(name)
    # The step as of the last transition, or the newest checkpoint's if later: what a
    # new leader exports until the agents' replays tell it the step they are at.
    job.progress.step = max(state.step, job.last_checkpoint.step if job.last_checkpoint else 0)
    if state.initial_loss is not None:
        job.progress.initial_loss = job.progress.loss = state.initial_loss
        job.progress.has_loss = job.progress.initial_loss_stored = True
    job.health.new_generation(job.generation, job.rank_nodes)
    job.health.restore([record.event for record in store.events(name)])
    if not job.state.terminal:
        # Intents of an earlier generation no longer apply; the reconcile loop deletes them.
        operation = store.operation(name)
        if operation is not None and operation.generation == job.generation:
            job.intents.operation = Operation.from_record(operation)
        request = store.checkpoint_request(name)
        if request is not None and request.generation == job.generation:
            job.intents.checkpoint_request = request
    return job


def carry_over(old: JobRuntime, fresh: JobRuntime) -> None:
    """Give ``fresh`` (as etcd has the job) what this controller knew that etcd does
    not hold: the job's progress and health record always, and what its agents
    reported of the generation if etcd's is still the one they reported on."""
    fresh.health, fresh.progress = old.health, old.progress
    for name in ("unrecorded", "unrecorded_memory_snapshot", "checkpoint_problems", "recovery"):
        setattr(fresh, name, getattr(old, name))
    if fresh.state is old.state and fresh.generation == old.generation:
        # No transition happened that this controller missed: its accounting is ahead
        # of etcd's (the steps since the last write), else etcd's holds the transition.
        fresh.goodput = old.goodput
    if fresh.generation != old.generation:
        fresh.health.new_generation(fresh.generation, fresh.rank_nodes)
        return
    for name in ("exits", "stopped_nodes", "lost_nodes", "vanished"):
        setattr(fresh, name, getattr(old, name))
    fresh.rendezvous = fresh.rendezvous or old.rendezvous
    fresh.deadlines = fresh.deadlines or old.deadlines
    if old.intents.operation is not None and (
        fresh.intents.operation is None or old.intents.operation.begun
    ):
        fresh.intents.operation = old.intents.operation
    if fresh.state is old.state:
        fresh.state_since_mono = old.state_since_mono
