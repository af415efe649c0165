"""Validation of submitted job specs: every error names the field and the fix."""

from __future__ import annotations

import enum
import os
import re

from common import env
from common.keys import JOB_NAME, JOB_NAME_RULE
from common.paths import inside
from common.proto_enums import ProtoEnum
from orchestrator import planner
from orchestrator.planner.sizing import cluster_for, model_shape, training_shape
from orchestrator.spec import health
from protos import keel_pb2

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_RESTARTS_LIMIT = 1000
MAX_SLOTS = 1024  # the most rank slots an agent may offer


class OnNoCheckpoint(str, enum.Enum):
    """What a job that has recorded checkpoints does when none of them verifies, as a
    spec file spells it (``on_no_checkpoint = "fresh_start"``)."""

    FAIL = "fail"  # the default: end FAILED, listing each checkpoint and why
    FRESH_START = "fresh_start"  # start again from step 0, with an event


WIRE_ON_NO_CHECKPOINT = ProtoEnum(OnNoCheckpoint, keel_pb2.OnNoCheckpoint, "ON_NO_CHECKPOINT_")


class InvalidSpec(ValueError):
    """A job spec that cannot run; ``problems`` lists every problem found, and the
    message joins them."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def validate(spec: keel_pb2.JobSpec) -> None:
    problems = []
    if not JOB_NAME.match(spec.name):
        problems.append(f"name {spec.name!r}: {JOB_NAME_RULE}")
    if spec.world_size < 1:
        problems.append("world_size: must be at least 1")
    if not spec.command or not spec.command[0]:
        problems.append(
            "command: give the argv each rank runs, e.g. ['python', '-m', 'trainer.train']"
        )
    if spec.max_restarts > MAX_RESTARTS_LIMIT:
        problems.append(
            f"max_restarts: {spec.max_restarts} is more than "
            f"{MAX_RESTARTS_LIMIT}; a job failing that often needs a person"
        )
    if spec.checkpoint_dir and not os.path.isabs(spec.checkpoint_dir):
        problems.append(f"checkpoint_dir {spec.checkpoint_dir!r}: must be an absolute path")
    if spec.resume_from and not os.path.isabs(spec.resume_from):
        problems.append(f"resume_from {spec.resume_from!r}: must be an absolute path")
    elif spec.resume_from and (
        spec.resume_from == spec.checkpoint_dir or inside(spec.resume_from, spec.checkpoint_dir)
    ):
        problems.append(
            f"resume_from {spec.resume_from!r}: lies in the job's own checkpoint_dir; a "
            f"resume source is read, never changed: give the new job a checkpoint_dir of "
            f"its own"
        )
    if spec.working_dir and not os.path.isabs(spec.working_dir):
        problems.append(
            f"working_dir {spec.working_dir!r}: must be an absolute path (the "
            f"same directory on every node)"
        )
    if spec.ranks_per_node > MAX_SLOTS:
        problems.append(
            f"ranks_per_node: {spec.ranks_per_node} is more than any node's {MAX_SLOTS} slots"
        )
    for key in spec.env:
        if not ENV_NAME.match(key):
            problems.append(f"env {key!r}: not a valid environment variable name")
        elif key in env.SET_FOR_RANKS:
            problems.append(f"env {key!r}: set by Keel for every rank; remove it")
    try:
        health.resolve(spec.health)
    except health.InvalidHealth as exc:
        problems.append(f"health: {exc}")
    shapes = None
    if spec.model.params and spec.world_size >= 1:
        # What the planner is given, checked now whatever the mesh, not at the first
        # placement. The node size is not known before placement.
        try:
            shapes = (
                model_shape(spec),
                cluster_for(spec, spec.world_size, spec.world_size),
                training_shape(spec),
            )
        except ValueError as exc:
            problems.append(f"model/training: {exc}")
    if spec.mesh and spec.mesh != "auto" and spec.world_size >= 1:
        try:
            layout = planner.Layout.parse(spec.mesh)
            if layout.world_size != spec.world_size:
                raise planner.LayoutError(
                    f"layout {spec.mesh} spans {layout.world_size} ranks but world_size is "
                    f"{spec.world_size}; make the axes multiply to the world size"
                )
            if shapes:
                model, cluster, training = shapes
                planner.validate_layout(layout, model, cluster, training)
        except ValueError as exc:
            problems.append(f"mesh: {exc}")
    if problems:
        raise InvalidSpec(problems)
