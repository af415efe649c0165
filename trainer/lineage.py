"""Rank 0's side of checkpoint lineage (``common.lineage``): before anything is written
in the job's checkpoint directory, refuse one that holds another lineage's checkpoints;
then claim it under the job's name, id and lineage, the chain the restored checkpoint
names with this job last."""

from __future__ import annotations

from trainer import fence
from trainer.restore import Restored
from trainer.runtime import Owner, Runtime, lineage_refusal


def refuse_foreign(checkpoint_dir: str | None, runtime: Runtime) -> None:
    """Raises fence.ForeignLineage (reported to the agent as ``foreign_lineage``) if
    ``checkpoint_dir`` holds checkpoints of a lineage other than the job's. Under plain
    torchrun (no job id) there is no lineage to check."""
    if not checkpoint_dir or not runtime.job_id:
        return
    why = lineage_refusal(checkpoint_dir, runtime.job_id, runtime.restore_from or "")
    if why:
        runtime.log(f"refusing the checkpoint directory: {why}")
        runtime.report_checkpoint_problem(0, checkpoint_dir, "foreign_lineage", why)
        raise fence.ForeignLineage(why)


def descent(restored: Restored | None, runtime: Runtime) -> tuple[str, ...]:
    """The job's lineage: the restored checkpoint's, continued by this job when it
    resumed another's (or started fresh); empty under plain torchrun."""
    chain = restored.lineage if restored else ()
    if runtime.job_id and (not chain or chain[-1] != runtime.job_id):
        chain = (*chain, runtime.job_id)
    return chain


def claimant(runtime: Runtime, chain: tuple[str, ...]) -> Owner | None:
    """What the fence of this generation records (None under plain torchrun)."""
    if not runtime.job_id:
        return None
    return Owner(runtime.generation, runtime.job_id, runtime.job, chain)
