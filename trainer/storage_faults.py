"""Which failures of a checkpoint save are the storage's (no space left, a quota, an I/O
error): training goes on after them (``trainer.checkpoint``); anything else fails the
rank. And the report of a fence lock held past its deadline (``trainer.fence``).

A failed write reaches the trainer in one of three shapes. Where the trainer writes
itself (the staging directory, the ledger, the manifest, the rename), it is the
OSError. Where DCP writes, its collective save gathers each rank's failure to the
coordinator and raises them on every rank as one ``CheckpointException``; the failures
cross processes pickled, so an OSError keeps its errno but loses what it was raised
from. And a tensor DCP writes through ``torch.save`` goes through torch's zip stream
writer (``caffe2/serialize/inline_container.cc``), which swallows the OSError of a
short or failed write and raises a RuntimeError of its own: on a 1 MiB tmpfs with room
for part of a shard, ``[enforce fail at inline_container.cc:672] . unexpected pos 704
vs 598`` (torch 2.13). Saving, that writer fails only on a write, so its RuntimeError
counts as the storage's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

from trainer import fence
from trainer.runtime import Runtime

# In the message of every error torch's zip stream writer raises.
TORCH_STREAM_WRITER = "inline_container.cc"


@dataclass(frozen=True)
class StorageFault:
    """What a failed save comes down to: ``error``, an OSError or torch's stream
    writer's RuntimeError, on ``ranks`` (those DCP's collective save names; empty:
    this rank's own write)."""

    error: BaseException
    ranks: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = ""
        if self.ranks:
            plural = "s" if len(self.ranks) > 1 else ""
            where = f" on rank{plural} {', '.join(map(str, self.ranks))}"
        text = f"{type(self.error).__name__}{where}: {self.error}"
        if not isinstance(self.error, OSError):
            text += " (torch's file writer was refused a write: no space, a quota, an I/O error)"
        return text


def storage_fault(error: BaseException) -> StorageFault | None:
    """The storage fault a failed save's ``error`` comes down to: a write error that is
    ``error`` or what it was raised from or during, or, for DCP's CheckpointException,
    the one under every rank's failure. None for anything else: a bug, on any rank; a
    refusal (``fence.Superseded``); a fence lock held too long (``fence.FenceTimeout``,
    an OSError too, as every TimeoutError is)."""
    if isinstance(error, CheckpointException):
        found = {rank: _write_error_under(failure) for rank, (failure, _) in error.failures.items()}
        if not found or None in found.values():
            return None
        ranks = tuple(sorted(found))
        return StorageFault(found[ranks[0]], ranks)
    under = _write_error_under(error)
    return StorageFault(under) if under is not None else None


def _write_error_under(error: BaseException | None) -> BaseException | None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (fence.Superseded, fence.FenceTimeout)):
            return None
        if isinstance(error, OSError):
            return error
        if isinstance(error, RuntimeError) and TORCH_STREAM_WRITER in str(error):
            return error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return None


def report_fence_timeout(runtime: Runtime, step: int, stalled: fence.FenceTimeout) -> None:
    """Logs ``stalled`` and reports it to the agent as a ``fence_timeout`` problem of
    checkpoint ``step`` (0: before any), naming the lock holder's node as the suspect."""
    runtime.log(f"cannot take the checkpoint directory's fence: {stalled}", step=step)
    runtime.report_checkpoint_problem(
        step, stalled.directory, "fence_timeout", str(stalled), suspect_node=stalled.node
    )
