"""Whether a submitted job may join the jobs etcd holds: a checkpoint directory is one
job's (``common.lineage``). Pure: the controller passes what it holds of each job."""

from __future__ import annotations

import os
from collections.abc import Iterable

from protos import keel_pb2


def directory_taken(spec: keel_pb2.JobSpec, jobs: Iterable[tuple[str, str, str, str]]) -> str:
    """Why ``spec`` may not be submitted next to ``jobs`` (name, id, state and
    checkpoint directory of each job etcd holds, ended ones too until deleted): another
    of them writes its checkpoints in the directory it names; "" if none does. Paths
    are compared as normalized text (the controller may not see the filesystem)."""
    if not spec.checkpoint_dir:
        return ""
    wanted = os.path.normpath(spec.checkpoint_dir)
    for name, job_id, state, checkpoint_dir in jobs:
        if checkpoint_dir and os.path.normpath(checkpoint_dir) == wanted:
            return (
                f"checkpoint_dir {spec.checkpoint_dir} is job {name}'s (id {job_id}, "
                f"{state}): two jobs never share one. Give this job a checkpoint_dir of its "
                f"own; to start from {name}'s checkpoints, add resume_from = "
                f'"{spec.checkpoint_dir}" (keel run/up: --resume-from) as well'
            )
    return ""
