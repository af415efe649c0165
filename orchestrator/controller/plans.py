"""A generation's plan as etcd keeps it (``/keel/jobs/<job>/plans/<generation>``):
written with the move to STARTING (where the ranks go) and again with the move to
RUNNING (with the rendezvous endpoint), so that a controller that takes over, or this
one after a write whose reply it lost, can prepare or start the generation again
rather than guess. The one place that knows the record's shape, both ways."""

from __future__ import annotations

import time

from google.protobuf import json_format

from orchestrator.controller.job_runtime import JobRuntime
from orchestrator.policy.placement import NodeRanks
from protos import keel_pb2


def plan_record(job: JobRuntime, **fields) -> dict:
    """The plan of ``job``'s generation, taking ``fields`` (any of generation,
    world_size, mesh, placement, placed_agents, deadlines, restore_from,
    restore_fallbacks, rendezvous) in place of the job's own: a plan is written before
    the job in memory adopts it."""

    def get(name):
        return fields[name] if name in fields else getattr(job, name)

    unknown = fields.keys() - {
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
    if unknown:
        raise TypeError(f"plan_record: no plan field {', '.join(sorted(unknown))}")
    host, port = get("rendezvous") or ("", 0)
    restore, deadlines = get("restore_from"), get("deadlines")
    return {
        "generation": get("generation"),
        "world_size": get("world_size"),
        "master_addr": host,
        "master_port": port,
        "nodes": {p.node: list(p.ranks) for p in get("placement")},
        "restore_from": restore["path"] if restore else "",
        "restore_fallbacks": list(get("restore_fallbacks")),
        "command": list(job.spec.command),
        "mesh": get("mesh"),
        "agents": dict(get("placed_agents")),
        "deadlines": (
            json_format.MessageToDict(deadlines, preserving_proto_field_name=True)
            if deadlines is not None
            else {}
        ),
        "created_at": time.time(),
    }


def adopt_plan(job: JobRuntime, plan: dict, records: list[dict]) -> None:
    """Give ``job`` (read from etcd) its generation's ``plan``; ``records`` are its
    checkpoint records, to find the restore point's."""
    job.world_size, job.mesh = plan["world_size"], plan["mesh"]
    if job.state.terminal:
        return
    job.placement = [NodeRanks(n, tuple(r)) for n, r in plan["nodes"].items()]
    if plan.get("master_port"):
        job.rendezvous = (plan["master_addr"], plan["master_port"])
    job.placed_agents = plan.get("agents", {})
    if plan.get("restore_from"):
        job.restore_from = next(
            (r for r in records if r["path"] == plan["restore_from"]),
            {"path": plan["restore_from"]},
        )
    job.restore_fallbacks = plan.get("restore_fallbacks", [])
    if plan.get("deadlines"):
        job.deadlines = json_format.ParseDict(plan["deadlines"], keel_pb2.Deadlines())
