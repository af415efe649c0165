"""Collective timeouts that fail fast and say who is missing.

- Start-up gets a long process-group timeout (``--startup-timeout-s``): loading a
  checkpoint, building the model and the preflight sweep may keep some ranks busy
  for minutes. After the first step every training collective is a matter of
  seconds, so the timeout shrinks (``--collective-timeout-s``); a rank stuck in one
  then fails within it instead of gloo's 30 or NCCL's 10 minutes.
- A monitored barrier at generation start names the ranks that did not arrive.
- On NCCL, the watchdog aborts a timed-out collective (``TORCH_NCCL_ASYNC_ERROR_HANDLING``)
  and the flight recorder dumps the last collectives of every rank on timeout, so the
  dump names the collective each rank was in.

Deadlines, shortest first: the agent's hang timeout < its stop grace < the collective
timeout. The agent should find a hung rank and dump its stacks before its peers fail
their collectives and bury the root cause in timeouts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch.distributed as dist

# Private, but the one way to change a live group's timeout (gloo and NCCL alike); it
# is in every torch this package allows (>= 2.13).
from torch.distributed.distributed_c10d import _set_pg_timeout

from trainer.runtime import env

NCCL_TRACE_BUFFER_SIZE = 2000
# File-name prefix of the flight-recorder dumps; torch appends the rank.
TRACE_FILE_PREFIX = "nccl_trace_rank_"
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class StartBarrierError(RuntimeError):
    """Not every rank reached the barrier at generation start in time."""


def watchdog_dir(environ: Mapping[str, str], checkpoint_dir: str | None) -> str | None:
    """Where flight-recorder dumps go: ``$KEEL_WATCHDOG_DIR``, else
    ``<checkpoint_dir>/.watchdog``, else None (torch's default, ``/tmp``)."""
    if environ.get(env.WATCHDOG_DIR):
        return environ[env.WATCHDOG_DIR]
    if checkpoint_dir:
        return os.path.join(checkpoint_dir, ".watchdog")
    return None


def nccl_env(environ: Mapping[str, str], checkpoint_dir: str | None) -> dict[str, str]:
    """The NCCL watchdog and flight-recorder variables to add to ``environ``: those it
    does not set already (the user's own settings win). Pure."""
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_BUFFER_SIZE),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    directory = watchdog_dir(environ, checkpoint_dir)
    if directory:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(directory, TRACE_FILE_PREFIX)
    return {name: value for name, value in wanted.items() if name not in environ}


def arm_nccl(checkpoint_dir: str | None) -> dict[str, str]:
    """Sets ``nccl_env`` in this process's environment and creates the dump directory;
    call it before ``init_process_group``, which reads the variables. Returns what it set."""
    added = nccl_env(os.environ, checkpoint_dir)
    os.environ.update(added)
    dump_prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if dump_prefix:
        os.makedirs(os.path.dirname(dump_prefix) or ".", exist_ok=True)
    return added


def set_collective_timeout(timeout_s: float, groups: Iterable[dist.ProcessGroup]) -> None:
    """Sets the timeout of later collectives on the default group and ``groups`` (each
    once) to ``timeout_s`` seconds."""
    timeout = timedelta(seconds=timeout_s)
    done: list[dist.ProcessGroup] = []
    for group in [dist.group.WORLD, *groups]:
        if not any(group is seen for seen in done):
            _set_pg_timeout(timeout, group)
            done.append(group)


def missing_ranks(error_text: str) -> list[int] | None:
    """The ranks a failed ``monitored_barrier`` on rank 0 names, or None if the text
    does not name any (other ranks see only that rank 0 gave up)."""
    match = _MISSING_RANKS.search(error_text)
    if not match:
        return None
    return [int(rank) for rank in match.group(1).replace(",", " ").split()]


def start_barrier_message(rank: int, world_size: int, timeout_s: float, error_text: str) -> str:
    """What a failed start barrier says on ``rank``. Pure."""
    missing = missing_ranks(error_text)
    if missing is not None:
        arrived = world_size - len(missing)
        who, they, their = (
            ("ranks", "they", "their logs") if len(missing) > 1 else ("rank", "it", "its log")
        )
        return (
            f"generation start: {who} {', '.join(map(str, missing))} did not reach the start "
            f"barrier within {timeout_s:g} s ({arrived}/{world_size} ranks arrived): {they} died, "
            f"hung, or started too slowly for --startup-timeout-s; look at {their} "
            f"({error_text.strip()})"
        )
    return (
        f"generation start: rank {rank} failed in the start barrier "
        f"(rank 0 waits at most {timeout_s:g} s and "
        f"names the missing ranks in its own error; look there first) ({error_text.strip()})"
    )


def start_barrier(timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
    """Waits until every rank of ``group`` (a gloo group; default the whole world) has
    arrived, for at most ``timeout_s`` seconds. Raises ``StartBarrierError`` naming the
    ranks that did not arrive (on rank 0; other ranks learn only that rank 0 gave up)."""
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as error:
        message = start_barrier_message(
            dist.get_rank(), dist.get_world_size(group), timeout_s, str(error)
        )
        raise StartBarrierError(message) from error
