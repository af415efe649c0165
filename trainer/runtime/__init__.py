"""The library a training script uses to live under Keel: the rank's identity from its
environment (``identity``), its structured logs (``Runtime.log``), step, checkpoint and
preflight reports to the node agent and the agent's checkpoint requests
(``reporting``), stack dumps on SIGUSR1, and scripted fault injection (``faults``).

A ``Runtime`` configures the rank's logs (``common.logs``): lines on stderr, JSON unless
stderr is a terminal (``KEEL_LOG_FORMAT`` and ``KEEL_LOG_LEVEL`` override), each with
component ``trainer``, the ``rank`` and, under Keel, the ``job`` and ``generation``.
Tracebacks of uncaught exceptions stay plain text on stderr, for the agent.

Everything degrades to a no-op under plain ``torchrun``: without ``KEEL_AGENT_SOCKET``
nothing is sent, without ``KEEL_FAULTS`` nothing is injected. Reporting never blocks or
fails a training step; an unreachable agent costs one line on stderr.

Steps are numbered from 1: step N is the N-th optimizer step of the job, a fault at
step N fires when step N starts, and a report for step N is sent after it finished.

Restart in place (``init(restart_in_place=True)``): when a generation ends under the
rank (``in_place.ended_under_the_rank``: a collective failed because a peer is gone,
or the agent asked it to leave, ``leave_requested``), the script calls
``next_generation(error, teardown)``. That shuts down every TCP connection the rank
opened during the generation (gloo's to its peers among them, so that peers blocked
on this rank fail at once instead of at their timeout), runs ``teardown`` (destroy the
process group and what was built on it), parks the rank with its agent and waits. It
returns True once this process has become the next generation's rank on the same slot
(its environment, output files and this ``Runtime`` are that rank's: set up the
process group again and restore), and False when the rank cannot be kept (re-raise the
error: it exits as it would have). Told by the agent that no generation wants it, it
exits 0. A process restarts in place at most ``MAX_IN_PLACE_RESTARTS`` times (gloo
leaves a listening socket per generation behind). The reference trainer's ``main`` is
the pattern.

The layout grammar (``Layout``, ``parse_mesh``) and the environment's names (``env``)
are the ones the whole of Keel uses; a trainer reaches them here.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

import structlog

from common import env, logs
from common.adopt import take_environment, take_output
from common.layout import MESH_DIM_NAMES, Layout, LayoutError
from common.lineage import FenceUnreadable, Owner, checkpoints_in, read_owner
from common.lineage import refusal as lineage_refusal
from common.paths import inside
from common.wire_kinds import Collective
from protos import keel_pb2
from trainer.runtime.faults import (
    FaultInjector,
    claim_fault,
    fault_marker_path,
    parse_fault_schedule,
    rank_faults,
)
from trainer.runtime.identity import (
    Identity,
    deadline_problems,
    fence_timeout_s,
    job_deadlines,
    parse_mesh,
    read_identity,
)
from trainer.runtime.in_place import (
    GenerationEnded,
    ended_under_the_rank,
    sever,
    tcp_connections,
    torch_memory_released,
)
from trainer.runtime.reporting import CHECKPOINT_REPORT_DEADLINE_S, FLUSH_WAIT_S, AgentReporter

_log = structlog.get_logger()

MAX_IN_PLACE_RESTARTS = 32
# Outside Keel the job's deadlines are common.deadlines' defaults.
OUTSIDE_KEEL_FENCE_TIMEOUT_S = fence_timeout_s({})

__all__ = [
    "CHECKPOINT_REPORT_DEADLINE_S",
    "Collective",
    "FLUSH_WAIT_S",
    "FenceUnreadable",
    "MESH_DIM_NAMES",
    "GenerationEnded",
    "Identity",
    "Layout",
    "LayoutError",
    "Owner",
    "Runtime",
    "checkpoints_in",
    "ended_under_the_rank",
    "claim_fault",
    "deadline_problems",
    "env",
    "fault_marker_path",
    "fence_timeout_s",
    "init",
    "inside",
    "job_deadlines",
    "lineage_refusal",
    "parse_fault_schedule",
    "parse_mesh",
    "rank_faults",
    "read_owner",
]


class Runtime:
    """One rank's view of its job. Build it with ``init()``.

    Attributes: ``rank``, ``world_size``, ``local_rank`` (ints), ``generation`` (int, 0
    without Keel), ``job`` and ``node`` (str, "" without Keel), ``mesh`` (dimension → size),
    ``checkpoint_dir`` and ``restore_from`` (absolute paths or None), ``restart_count``
    (int), ``slow_factor`` (float, step-time multiplier from a ``slow`` fault, 1.0 if none),
    ``restart_in_place`` (bool: it may take the next generation in this process),
    ``job_id`` (str, the job's unique id, its lineage's; "" without Keel),
    ``resume_from`` (another lineage's checkpoint or directory to start from, or None),
    ``local_world_size``, ``memory_dir`` and ``memory_budget_bytes`` (the memory
    tier's, see ``trainer.memory_tier``; None and 0 without one) and
    ``fence_timeout_s`` (float: how long it waits for its checkpoint directory's fence
    lock, from the job's deadlines: ``identity.fence_timeout_s``).
    """

    def __init__(
        self,
        identity: Identity,
        faults: keel_pb2.FaultSchedule,
        fence_after_s: float | None = None,
        restart_in_place: bool = False,
        fence_timeout_s: float = OUTSIDE_KEEL_FENCE_TIMEOUT_S,
    ) -> None:
        """The rank ``identity`` names, its scripted ``faults``; ``fence_after_s``: it
        stops itself when its agent answers nothing for this long (None: never);
        ``fence_timeout_s``: see the class's docstring."""
        self.identity = identity
        self.node = identity.node
        self.fence_timeout_s = fence_timeout_s
        rank, generation, job = identity.rank, identity.generation, identity.job
        self.rank, self.world_size, self.local_rank = rank, identity.world_size, identity.local_rank
        self.generation, self.job, self.mesh = generation, job, identity.mesh
        self.checkpoint_dir, self.restore_from = identity.checkpoint_dir, identity.restore_from
        self.restore_fallbacks = identity.restore_fallbacks
        self.job_id, self.resume_from = identity.job_id, identity.resume_from
        self.local_world_size = identity.local_world_size
        self.memory_dir, self.memory_budget_bytes = (
            identity.memory_dir,
            identity.memory_budget_bytes,
        )
        self.restart_count = identity.restart_count
        self.agent_socket = identity.agent_socket
        self.restart_in_place = restart_in_place
        # Connections from before this generation are not its to sever.
        self._connections_before = set(tcp_connections().values()) if restart_in_place else set()
        self.restarted_in_place = getattr(self, "restarted_in_place", 0)
        under_keel = {"job": job, "generation": generation, "node": identity.node}
        logs.configure("trainer", rank=rank, **{k: v for k, v in under_keel.items() if v})
        self._faults = FaultInjector(faults, rank, generation, self.log, identity.node)
        self._agent = (
            AgentReporter(
                identity.agent_socket,
                rank=rank,
                world_size=identity.world_size,
                generation=generation,
                job=job,
                log=self.log,
                fence_after_s=fence_after_s,
                token=identity.agent_token,
                restart_in_place=restart_in_place,
            )
            if identity.agent_socket
            else None
        )

    @property
    def slow_factor(self) -> float:
        return self._faults.slow_factor

    @property
    def recorded_step(self) -> int:
        """The newest checkpoint the controller recorded in etcd, as last heard from the
        agent (0: none yet, or no agent)."""
        return self._agent.recorded_step if self._agent is not None else 0

    def log(self, message: str, **fields: object) -> None:
        """Logs event ``message`` with ``fields`` at level info: one line on stderr,
        tagged with the job, generation and rank (see the module's docstring)."""
        _log.info(message, **fields)

    def report_step(
        self,
        step: int,
        loss: float,
        tokens: int,
        step_time_s: float,
        *,
        data_s: float = 0.0,
        compute_s: float = 0.0,
        optimizer_s: float = 0.0,
        checkpoint_s: float = 0.0,
        checkpointing: bool = False,
        restore_s: float = 0.0,
    ) -> None:
        """Queues the report of finished step ``step`` for the agent and returns at once.
        ``tokens`` are the tokens this rank processed in the step; ``step_time_s`` is its
        own time for the step in seconds, before waiting on peers. The phases, in
        seconds: ``data_s`` (reading the batch), ``compute_s`` (forward and backward),
        ``optimizer_s``, and ``checkpoint_s``, the time the loop was blocked by a
        checkpoint since the previous report. ``checkpointing``: a checkpoint save
        follows this step; such a report is sent at once, so call this before the save.
        ``restore_s``: on the generation's first step, the seconds its restore took.
        A no-op without an agent."""
        if self._agent is not None:
            self._agent.report_step(
                step,
                loss,
                tokens,
                step_time_s,
                data_s=data_s,
                compute_s=compute_s,
                optimizer_s=optimizer_s,
                checkpoint_s=checkpoint_s,
                checkpointing=checkpointing,
                restore_s=restore_s,
            )

    def take_checkpoint_request(self) -> bool:
        """Whether the agent asked for a checkpoint since the last call (cleared by the
        call). Only this rank's own agent connection is seen, so fold the answer into a
        collective before acting on it. False without an agent."""
        return self._agent is not None and self._agent.take_checkpoint_request()

    def leave_requested(self) -> bool:
        """Whether the agent asked this rank to leave its generation (it is being
        stopped, and the rank can restart in place): fold it into a collective, leave
        after the same step as every rank (raise ``GenerationEnded``). False without an
        agent or restart in place."""
        return self.restart_in_place and self._agent is not None and self._agent.leave_requested()

    def next_generation(self, error: BaseException, teardown: Callable[[], bool | None]) -> bool:
        """After the generation ended under this rank with ``error``: tell the agent it
        is leaving, sever its connections, ``teardown()`` (the script's: wait for what
        it runs in the background, destroy the process group and what was built on it;
        False if something of the generation could not be stopped), park with the agent
        and wait to become the next generation's rank in this process. True when it has
        (this object, the environment and fds 1 and 2 are the new rank's); False when
        it cannot (``error`` is the rank's own, restart in place is off, the teardown
        failed, or the agent will not keep it): re-raise ``error``. Exits the process
        (status 0) when the agent says no generation takes it, or stops answering: it
        was counted out already."""
        agent = self._agent
        if agent is None or not self.restart_in_place or not ended_under_the_rank(error):
            return False
        if self.restarted_in_place >= MAX_IN_PLACE_RESTARTS:
            self.log(f"restarted in place {self.restarted_in_place} times already: exiting")
            return False
        asked = agent.leave_requested()
        failed = not isinstance(error, GenerationEnded)
        reason = "".join(traceback.format_exception(error)) if failed else "asked to leave"
        refused = agent.park(failed and not asked, reason, tearing_down=True)
        if refused:
            self.log(f"not restarting in place ({refused}): exiting")
            return False
        began = time.monotonic()
        sever(self._connections_before)
        if teardown() is False:
            self.log("the generation could not be torn down: not restarting in place")
            return False
        torch_memory_released()
        refused = agent.park(failed and not asked, reason)
        if refused:
            self.log(f"not restarting in place ({refused}): exiting")
            return False
        self.log(
            "left generation alive; waiting for the next",
            left=self.generation,
            teardown_s=round(time.monotonic() - began, 3),
            cause=f"{type(error).__name__}: {str(error)[:200]}",
        )
        answer = agent.next_generation()
        agent.close()
        self._agent = None
        if answer.action != keel_pb2.NEXT_GENERATION_ACTION_START:
            self.log(f"not needed for a next generation ({answer.reason}): exiting")
            sys.exit(0)
        take_environment(answer.env)
        take_output(answer.stdout, answer.stderr)
        self.restarted_in_place += 1
        self.__init__(**_settings(os.environ), restart_in_place=True)
        self.log("restarted in place", rank=self.rank, world_size=self.world_size)
        return True

    def report_preflight(self, results: Sequence, wall_s: float) -> bool:
        """Sends this rank's preflight sweep to the agent (``AgentReporter``); whether
        the agent acknowledged. False without an agent."""
        return self._agent is not None and self._agent.report_preflight(results, wall_s)

    def report_checkpoint(
        self, step: int, path: str, samples: int, *, save_s: float = 0.0, size: int = 0
    ) -> bool:
        """Tells the agent that the checkpoint of step ``step`` is durable at ``path``
        (``samples``: global data position after it; ``save_s``: seconds from the save's
        start to now; ``size``: its bytes); whether the agent acknowledged. False
        without an agent."""
        return self._agent is not None and self._agent.report_checkpoint(
            step, path, samples, save_s=save_s, size=size
        )

    def report_memory_snapshot(
        self, step: int, samples: int, *, size: int = 0, save_s: float = 0.0
    ) -> bool:
        """Tells the agent that the memory snapshot of step ``step`` is committed on
        every node (``samples``: global data position after it; ``size``: the tensor
        bytes of every rank's shards; ``save_s``: from its start to its commit); whether
        the agent acknowledged. False without an agent."""
        return self._agent is not None and self._agent.report_memory_snapshot(
            step, samples, size=size, save_s=save_s
        )

    def report_checkpoint_problem(
        self, step: int, path: str, kind: str, reason: str, *, suspect_node: str = ""
    ) -> bool:
        """Tells the agent of a checkpoint this rank would not or could not use or save
        (``kind``, a ``CheckpointProblemKind`` or its string): a commit refused because
        a newer generation owns the directory (``"stale_commit"``), one that failed
        verification and was renamed aside (``"quarantined"``), a save that failed
        (``"save_failed"``: no space, an I/O error), a fence lock held past its
        deadline (``"fence_timeout"``), one a node could not read (``"unreachable"``), a
        directory of another lineage (``"foreign_lineage"``). ``suspect_node``: the node
        the problem points at, when not this one (the fence lock's holder, the node that
        could not read). False without an agent."""
        return self._agent is not None and self._agent.report_checkpoint_problem(
            step, path, kind, reason, suspect_node=suspect_node
        )

    def flush(self) -> bool:
        """Waits until every step report queued so far was sent; True without an agent."""
        return self._agent is None or self._agent.flush()

    def inject_faults(self, step: int) -> None:
        """Applies this rank's scheduled faults for step ``step``; call it when the step
        starts (``FaultInjector.inject``; one-shot faults remembered in
        ``checkpoint_dir``)."""
        self._faults.inject(step, self.checkpoint_dir)

    def after_step(self, compute_s: float) -> float:
        """Stretches a step that computed for ``compute_s`` seconds by ``slow_factor``;
        returns the seconds slept."""
        return self._faults.after_step(compute_s)

    def close(self) -> None:
        """Sends pending step reports (waiting at most ``FLUSH_WAIT_S`` seconds) and
        closes the agent channel. Safe to call twice."""
        if self._agent is not None:
            self._agent.close()
            self._agent = None


def _settings(environ: Mapping[str, str]) -> dict:
    """``Runtime``'s arguments from ``environ``."""
    # Under Keel, a rank whose agent answers nothing for the collective timeout stops.
    return dict(
        identity=read_identity(environ),
        faults=parse_fault_schedule(environ.get(env.FAULTS)),
        fence_after_s=job_deadlines(environ).get("collective_timeout_s"),
        fence_timeout_s=fence_timeout_s(environ),
    )


def init(environ: Mapping[str, str] | None = None, *, restart_in_place: bool = False) -> Runtime:
    """Builds this rank's ``Runtime`` from ``environ`` (default ``os.environ``): the
    torchrun variables, ``KEEL_*`` when Keel started the rank. Installs a SIGUSR1
    handler that dumps every thread's Python stack to stderr, for hang diagnosis.
    ``restart_in_place``: the script calls ``next_generation`` when a generation ends
    under it (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    runtime = Runtime(**_settings(environ), restart_in_place=restart_in_place)
    # The process's own fd 2, which the agent captures, even when sys.stderr has been
    # swapped for something without a file descriptor.
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    return runtime
