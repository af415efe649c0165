"""The next generation's world size and layout for a job spec, and what the planner is
told of the spec's model, training and cluster. Pure."""

from __future__ import annotations

from common.proto_enums import ProtoEnum
from orchestrator.planner.ranking import best
from orchestrator.planner.shapes import Cluster, ModelShape, Precision, Training
from protos import keel_pb2

# TrainingShape.precision; the planner takes the strings.
WIRE_PRECISIONS = ProtoEnum(Precision, keel_pb2.Precision, "PRECISION_")


def model_shape(spec: keel_pb2.JobSpec) -> ModelShape:
    m = spec.model
    return ModelShape(
        params=m.params, layers=m.layers, hidden=m.hidden, heads=m.heads, vocab=m.vocab
    )


def training_shape(spec: keel_pb2.JobSpec) -> Training:
    t = spec.training
    fields = {
        "seq_len": t.seq_len,
        "micro_batch": t.micro_batch,
        "global_batch": t.global_batch or None,
        "microbatches": t.microbatches,
        # Unset: the planner's default. Raises ValueError for a value this build lacks.
        "precision": WIRE_PRECISIONS.from_wire(t.precision).value if t.precision else None,
    }
    return Training(**{k: v for k, v in fields.items() if v})


def cluster_for(spec: keel_pb2.JobSpec, world_size: int, gpus_per_node: int) -> Cluster:
    return Cluster(
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        gpu_memory_gb=spec.training.gpu_memory_gb or 80.0,
    )


def size_and_layout(
    spec: keel_pb2.JobSpec, free_slots: dict[str, int], shrink: bool, max_world_size: int = 0
) -> tuple[int, str]:
    """The world size and layout of the next generation. Pure.

    The spec's own size and layout when it is not shrinking; the planner's best layout
    when the spec says ``auto``; when shrinking, the largest world size that fits in
    ``free_slots`` (and ``max_world_size``, when given) and for which the planner finds
    a layout. Raises ValueError when none can run.
    """
    free = sum(free_slots.values())
    node_slots = max(free_slots.values(), default=0)
    ceiling = min(free, spec.world_size, max_world_size or spec.world_size)
    sizes = range(ceiling, 0, -1) if shrink else [spec.world_size]
    problems = []
    for world_size in sizes:
        if not shrink and spec.mesh and spec.mesh != "auto":
            return world_size, spec.mesh
        if not spec.model.params:
            # Nothing is known of the model: plain data parallel is all that is safe.
            return world_size, f"dp_shard={world_size}"
        try:
            chosen = best(
                model_shape(spec),
                cluster_for(spec, world_size, min(node_slots, world_size)),
                training_shape(spec),
            )
        except ValueError as exc:
            problems.append(f"world size {world_size}: {exc}")
            continue
        return world_size, str(chosen.layout)
    if not problems:
        raise ValueError("no free slots")
    # The largest size's problem says what to fix; thousands of smaller sizes' would
    # bloat the job's reason (kept in etcd) without saying more.
    smaller = len(problems) - 1
    raise ValueError(
        problems[0]
        + (f"; no layout at the {smaller} smaller world size(s) either" if smaller else "")
    )
