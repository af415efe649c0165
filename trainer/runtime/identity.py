"""Who this rank is, from its environment: torchrun's variables, and Keel's when Keel
started it (``common.env`` names and explains them). Outside Keel the Keel fields are
empty: generation 0, no job, no agent socket."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from common import deadlines, env
from common.layout import parse_axes


@dataclass(frozen=True)
class Identity:
    """``rank``, ``world_size``, ``local_rank`` and ``restart_count`` as torchrun gives
    them; ``generation`` (0 without Keel), ``job`` ("" without Keel), ``mesh``
    (dimension → size), ``checkpoint_dir`` and ``restore_from`` (paths or None) and
    ``agent_socket`` (None without an agent) as Keel does; ``restore_fallbacks``: older
    recorded checkpoints to restore if ``restore_from`` fails verification;
    ``job_id``: the job's unique id, its lineage's ("" without Keel); ``resume_from``:
    another lineage's checkpoint (or checkpoint directory) to start from while the job
    has recorded none of its own (None: none); ``local_world_size``: the ranks on its
    node; ``memory_dir``: the memory its agent holds for the job's snapshots
    (``trainer.memory_tier``; None: no memory tier) and ``memory_budget_bytes`` the most
    the node's snapshots may take there (0: no bound but the memory's own)."""

    rank: int
    world_size: int
    local_rank: int
    generation: int
    job: str
    mesh: dict[str, int]
    checkpoint_dir: str | None
    restore_from: str | None
    restore_fallbacks: tuple[str, ...]
    restart_count: int
    agent_socket: str | None
    agent_token: str = ""  # this rank's credential on the agent's socket
    node: str = ""  # the node it runs on, as its agent names it ("" without)
    job_id: str = ""
    resume_from: str | None = None
    local_world_size: int = 1
    memory_dir: str | None = None
    memory_budget_bytes: int = 0


def parse_mesh(text: str | None, world_size: int, source: str = "KEEL_MESH") -> dict[str, int]:
    """Parses ``KEEL_MESH`` ("dp_shard=4" or "dp_replicate=2,dp_shard=2,tp=1") into
    dimension → size, in the order given. Unset or empty means ``dp_shard`` over all
    ranks. The sizes must multiply to ``world_size``. ``source`` names where the text
    came from (``KEEL_MESH``, ``--layout``) in error messages."""
    return parse_axes(text, world_size, source)


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not an integer; unset it or give a whole number"
        ) from None


def read_identity(environ: Mapping[str, str]) -> Identity:
    """This rank's ``Identity`` from ``environ``; raises ValueError naming a variable
    that does not parse."""
    world_size = _int(environ, "WORLD_SIZE", 1)
    return Identity(
        rank=_int(environ, "RANK", 0),
        world_size=world_size,
        local_rank=_int(environ, "LOCAL_RANK", 0),
        generation=_int(environ, env.GENERATION, 0),
        job=environ.get(env.JOB, ""),
        mesh=parse_mesh(environ.get(env.MESH), world_size),
        checkpoint_dir=environ.get(env.CHECKPOINT_DIR) or None,
        restore_from=environ.get(env.RESTORE_FROM) or None,
        restore_fallbacks=tuple(
            p for p in environ.get(env.RESTORE_FALLBACKS, "").split(os.pathsep) if p
        ),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        agent_socket=environ.get(env.AGENT_SOCKET) or None,
        agent_token=environ.get(env.RANK_TOKEN, ""),
        node=environ.get(env.NODE, ""),
        job_id=environ.get(env.JOB_ID, ""),
        resume_from=environ.get(env.RESUME_FROM) or None,
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", 1),
        memory_dir=environ.get(env.MEMORY_DIR) or None,
        memory_budget_bytes=_int(environ, env.MEMORY_BUDGET_BYTES, 0),
    )


def job_deadlines(environ: Mapping[str, str]) -> dict[str, float]:
    """The job's side of the deadline chain that Keel put in ``environ`` (seconds by
    name: ``hang_floor_s``, ``stop_grace_s``, ``collective_timeout_s`` ...); {} outside
    Keel. Raises ValueError naming a variable that is not a number."""
    found = {}
    for name, variable in env.DEADLINES.items():
        if environ.get(variable):
            try:
                found[name] = float(environ[variable])
            except ValueError:
                raise ValueError(
                    f"{variable}={environ[variable]!r} is not a number of seconds"
                ) from None
    return found


def deadline_problems(environ: Mapping[str, str], **trainer: float) -> list[str]:
    """What in the job's deadline chain (``job_deadlines``) the trainer's own choices
    (``collective_timeout_s``, ``startup_timeout_s``) would break, each with its fix;
    [] outside Keel, where there is no chain."""
    given = job_deadlines(environ)
    if not given:
        return []
    try:
        # Resolved, not only checked: what the ranks are not told (the stop deadline,
        # the controller's alone) is derived as the controller derives it.
        deadlines.resolve(**{**given, **trainer})
    except deadlines.DeadlineError as exc:
        return exc.problems
    return []


def fence_timeout_s(environ: Mapping[str, str]) -> float:
    """How long rank 0 waits for its checkpoint directory's fence lock
    (``trainer.fence``), seconds: half the shorter of the job's first-step and
    checkpoint budgets (``common.deadlines``' defaults outside Keel).

    A generation starting while an old rank 0 holds the lock (stalled inside a fenced
    step) must fail naming the holder (``FenceTimeout``) before its agent declares it
    hung for missing its first step, which says nothing of the cause: the claim comes
    after the process start, the set-up and the preflight, and before the restore, all
    inside the first-step budget, and half of it is left for them. A save that waits
    for the lock does so inside the checkpoint budget, likewise. Raises ValueError
    naming a variable that is not a number."""
    given = job_deadlines(environ)
    chain = deadlines.Deadlines(
        **{
            name: given[name]
            for name in ("first_step_timeout_s", "checkpoint_timeout_s")
            if name in given
        }
    )
    return min(chain.first_step_timeout_s, chain.checkpoint_timeout_s) / 2
