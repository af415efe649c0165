"""The memory an agent holds for its jobs' snapshots (the memory tier's host side; the
trainer's is ``trainer.memory_tier``).

``keel agent --memory-budget-gb G`` gives a job running on the node a directory in
memory, ``ROOT/JOB_ID`` (ROOT: ``--memory-dir``, by default a directory of this agent's
own under ``/dev/shm``, a tmpfs), and tells its ranks where it is and how much of it
their snapshots may take (``KEEL_MEMORY_DIR``, ``KEEL_MEMORY_BUDGET_BYTES``). The
directory is the agent's, handed to the rank user where ranks run as one, so it
outlives every rank and every generation: a restarted rank finds the snapshot its
predecessor committed. It goes when the node has no more use for it:

- the job ends here: every rank of a generation on the node exited with status 0 of
  its own accord (the trainer does only once its last step is done and saved);
- another job starts on the node (a node runs one job at a time, and a snapshot is
  restored only from the memory of the nodes that wrote it).

An agent that restarts keeps what is there: the job's next generation may restore it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import structlog

from agent.rank_user import RankUser
from common import env as keel_env

log = structlog.get_logger("agent.memory")

SHARED_MEMORY = Path("/dev/shm")


def default_root(run_dir: Path) -> Path:
    """This agent's own directory under ``/dev/shm``: one per run directory, as there
    is one agent per run directory."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return SHARED_MEMORY / f"keel-{digest}"


def held_bytes(path: Path) -> int:
    """The bytes of the files under ``path``."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


class JobMemory:
    """The memory held for jobs under ``root``: at most ``budget_bytes`` for a job's
    snapshots (0: no memory tier). ``rank_user``: the owner of a job's directory."""

    def __init__(self, root: Path, budget_bytes: int, rank_user: RankUser | None = None) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.rank_user = rank_user

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def jobs(self) -> list[str]:
        """The job ids memory is held for."""
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_dir() and not entry.name.startswith(".")  # not agent.peer's copies
        )

    def hold(self, job_id: str) -> dict[str, str]:
        """The memory for job ``job_id``, made if it is not there, with every other
        job's released; the variables that tell its ranks (none without a memory tier
        or a job id). Raises OSError if it cannot be made."""
        if not self.enabled or not job_id:
            return {}
        for other in self.jobs():
            if other != job_id:
                self.release(other, f"job {job_id} starts on this node")
        path = self.root / job_id
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # passable, not listable, whatever the umask
        if not path.is_dir():
            path.mkdir(mode=0o700)
            log.info("memory held for the job", job_id=job_id, path=str(path))
        if self.rank_user is not None:
            self.rank_user.give(path, 0o700)
        return {
            keel_env.MEMORY_DIR: str(path),
            keel_env.MEMORY_BUDGET_BYTES: str(self.budget_bytes),
        }

    def give_tree(self, job_id: str) -> None:
        """Everything in job ``job_id``'s memory made the rank user's (a snapshot copy
        the agent brought in: the ranks read it, and remove it once they have a newer)."""
        if self.rank_user is None:
            return
        path = self.root / job_id
        for folder, directories, files in os.walk(path):
            for name in directories:
                self.rank_user.give(Path(folder) / name, 0o700)
            for name in files:
                self.rank_user.give(Path(folder) / name, 0o600)

    def close(self) -> None:
        """At the agent's exit: its directory goes if no job's memory is in it (what is
        held stays, for the job's next generation here)."""
        try:
            self.root.rmdir()
        except OSError:
            pass

    def release(self, job_id: str, why: str) -> int:
        """Gives back the memory of job ``job_id``; the bytes it held."""
        path = self.root / job_id
        if not job_id or not path.is_dir():
            return 0
        size = held_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        log.info("memory released", job_id=job_id, bytes=size, reason=why)
        return size
