"""Which job's lineage a checkpoint directory belongs to, and whether a job may write
there: the rule the agent applies before it starts a generation's ranks, the CLI before
it submits, and rank 0 before it touches the directory.

A job's *lineage* is the chain of job ids whose checkpoints it descends from, origin
first and the job itself last: a job started fresh is a lineage of one; a job started
with ``--resume-from`` another's checkpoint continues that lineage's chain under its
own id, in a directory of its own. The directory's fence (``.fence``, written by rank 0
of each generation, ``trainer.fence``) names its owner: the job id, the job's name, the
lineage and the generation. A job never writes, replaces or deletes checkpoints that
another lineage wrote (``refusal``); it reads them only when it resumes from them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from common.paths import inside

FENCE_FILE = ".fence"
# A checkpoint some lineage committed there (kept, or set aside by a failed verification).
_CHECKPOINT = re.compile(r"(?:\.quarantine\.)?step_\d{8,}(?:\.g\d+)?")


class FenceUnreadable(ValueError):
    """A fence file whose content is not a fence."""


@dataclass(frozen=True)
class Owner:
    """A checkpoint directory's owner as its fence names it: the ``generation`` of the
    job that may act there, the job's id and name, and its lineage (job ids, origin
    first). A fence written before jobs had ids holds only the generation."""

    generation: int
    job_id: str = ""
    job: str = ""
    lineage: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "job_id": self.job_id,
                "job": self.job,
                "lineage": list(self.lineage),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Owner:
        try:
            raw = json.loads(text)
            owner = cls(
                generation=int(raw["generation"]),
                job_id=str(raw.get("job_id", "")),
                job=str(raw.get("job", "")),
                lineage=tuple(str(j) for j in raw.get("lineage", ())),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FenceUnreadable(f"not a fence: {exc}") from None
        return owner

    def describe(self) -> str:
        """The owner as an operator reads it: "job train-7 (id 3f2a…, lineage a1…→3f2a…)"."""
        if not self.job_id:
            return f"a job of generation {self.generation} (a fence without a job id)"
        chain = "→".join(j[:8] for j in self.lineage) if self.lineage else self.job_id[:8]
        return f"job {self.job or '?'} (id {self.job_id}, lineage {chain})"


def read_owner(directory: str) -> Owner | None:
    """The owner ``directory``'s fence names; None if it has no fence. Raises
    FenceUnreadable (content) or OSError (the filesystem)."""
    try:
        with open(os.path.join(directory, FENCE_FILE)) as fence:
            return Owner.from_json(fence.read())
    except FileNotFoundError:
        return None


def checkpoints_in(directory: str) -> list[str]:
    """The names of the checkpoints some lineage committed in ``directory`` (sorted;
    none if it does not exist)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _CHECKPOINT.fullmatch(n))


def refusal(directory: str, job_id: str, restore_from: str = "") -> str:
    """Why job ``job_id`` may not write in ``directory`` ("" if it may): the directory
    holds checkpoints of another lineage. ``restore_from`` is the checkpoint the job's
    own records name, if any: the job's own checkpoints are then there even if the
    fence predates job ids (a directory of a job that ran before lineages). ``job_id``
    "" asks for a job not yet submitted, which owns no directory. Raises OSError if the
    directory cannot be read."""
    try:
        owner = read_owner(directory)
    except FenceUnreadable as exc:
        owner, unreadable = None, str(exc)
    else:
        unreadable = ""
    if owner is not None and owner.job_id and owner.job_id == job_id:
        return ""
    held = checkpoints_in(directory)
    if not held:
        return ""  # nothing of anyone's to lose: the job may take the directory
    if owner is not None and not owner.job_id and restore_from and inside(restore_from, directory):
        return ""  # its own, from before fences named their job
    if owner is not None and owner.job_id:
        whose = owner.describe()
    elif unreadable:
        whose = f"an unknown lineage (its {FENCE_FILE} is unreadable: {unreadable})"
    else:
        whose = "an unknown lineage (no fence names the job that wrote them)"
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return (
        f"{directory} holds checkpoints of {whose}: {shown}. A job never writes where "
        f"another lineage's checkpoints are. Either give this job a new checkpoint "
        f"directory, or start a new lineage from them explicitly: --resume-from "
        f"{directory} (resume_from in a spec), with a checkpoint directory of its own"
    )
