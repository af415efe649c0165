"""Where a job run on this machine (``keel up``, a local ``keel run``) writes its
checkpoints: its checkpoint directory, unless that holds another lineage's checkpoints
(``common.lineage``). Then the run is refused before anything starts, with the two
ways on; or, when it resumes from them (``--resume-from``) and the directory was only
the default one, the new lineage writes beside it, in the first free
``<directory>-<n>``."""

from __future__ import annotations

import itertools
from pathlib import Path

from common import lineage


def checkpoint_home(default: Path, resume_from: str, chosen: bool) -> tuple[Path, str]:
    """The directory the run writes its checkpoints in, and a line saying why it is not
    ``default`` ("" if it is). ``chosen``: the user named ``default`` (it is then used
    or refused, never replaced). Raises ValueError with the refusal."""
    why = lineage.refusal(str(default), "")
    if not why:
        return default, ""
    if not resume_from or chosen:
        raise ValueError(why)
    besides = (default.with_name(f"{default.name}-{n}") for n in itertools.count(2))
    beside = next(b for b in besides if not lineage.refusal(str(b), ""))
    return beside, (
        f"{default} holds another lineage's checkpoints; this run starts a new lineage "
        f"from {resume_from} (read, never changed) and writes its own in {beside}"
    )
