"""A rank's Runtime as trainer unit tests build it: rank 0 of one, no agent."""

from __future__ import annotations

from protos import keel_pb2
from trainer.runtime import Identity, Runtime


def one_rank(
    generation=2, job="", restore_from=None, fallbacks=(), resume_from=None, job_id=""
) -> Runtime:
    """Rank 0 of a world of one in ``generation`` of ``job`` (no agent: reports go
    nowhere), with the restore point, fallbacks, resume source and job id given."""
    return Runtime(
        Identity(
            rank=0,
            world_size=1,
            local_rank=0,
            generation=generation,
            job=job,
            mesh={"dp_shard": 1},
            checkpoint_dir=None,
            restore_from=restore_from,
            restart_count=0,
            agent_socket=None,
            restore_fallbacks=tuple(fallbacks),
            node="node-x",
            job_id=job_id,
            resume_from=resume_from,
        ),
        faults=keel_pb2.FaultSchedule(),
    )
