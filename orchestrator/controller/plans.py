"""A generation's plan as etcd keeps it (``/keel/jobs/<job>/generations/<generation>``):
written with the move to STARTING (where the ranks go) and again with the move to
RUNNING (with the rendezvous endpoint), so that a controller that takes over, or this
one after a write whose reply it lost, can prepare or start the generation again
rather than guess. A plan is built from a job here, and adopted by one here; its
stored form is ``common.records.PlanRecord``'s."""

from __future__ import annotations

import time

from common.records import CheckpointRecord, PlanRecord
from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.policy.placement import NodeRanks

PLAN_FIELDS = frozenset(
    {
        "generation",
        "world_size",
        "mesh",
        "placement",
        "placed_agents",
        "deadlines",
        "restore_from",
        "restore_fallbacks",
        "rendezvous",
    }
)


def plan_record(job: JobRuntime, **fields) -> PlanRecord:
    """The plan of ``job``'s generation, taking ``fields`` (any of ``PLAN_FIELDS``) in
    place of the job's own: a plan is written before the job in memory adopts it."""

    def get(name):
        return fields[name] if name in fields else getattr(job, name)

    unknown = fields.keys() - PLAN_FIELDS
    if unknown:
        raise TypeError(f"plan_record: no plan field {', '.join(sorted(unknown))}")
    host, port = get("rendezvous") or ("", 0)
    return PlanRecord(
        generation=get("generation"),
        world_size=get("world_size"),
        master_addr=host,
        master_port=port,
        nodes={p.node: list(p.ranks) for p in get("placement")},
        restore_from=get("restore_from"),
        restore_fallbacks=list(get("restore_fallbacks")),
        command=list(job.spec.command),
        mesh=get("mesh"),
        agents=dict(get("placed_agents")),
        deadlines=get("deadlines"),
        created_at_unix=time.time(),
    )


def adopt_plan(job: JobRuntime, plan: PlanRecord, records: list[CheckpointRecord]) -> None:
    """Give ``job`` (read from etcd) its generation's ``plan``; ``records`` are its
    checkpoint records, to find the restore point's step."""
    job.world_size, job.mesh = plan.world_size, plan.mesh
    if job.state.terminal:
        return
    job.placement = [NodeRanks(n, tuple(r)) for n, r in plan.nodes.items()]
    if plan.master_port:
        job.rendezvous = (plan.master_addr, plan.master_port)
    job.placed_agents = dict(plan.agents)
    job.restore_from = plan.restore_from
    job.restore_step = next((r.step for r in records if r.path == plan.restore_from), None)
    job.restore_fallbacks = list(plan.restore_fallbacks)
    job.deadlines = plan.deadlines
