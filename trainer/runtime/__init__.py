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

The layout grammar (``Layout``, ``parse_mesh``) and the environment's names (``env``)
are the ones the whole of Keel uses; a trainer reaches them here.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Mapping, Sequence

import structlog

from common import env, logs
from common.layout import MESH_DIM_NAMES, Layout, LayoutError
from common.paths import inside
from protos import keel_pb2
from trainer.runtime.faults import (FaultInjector, claim_fault, fault_marker_path,
                                    parse_fault_schedule, rank_faults)
from trainer.runtime.identity import (Identity, deadline_problems, job_deadlines, parse_mesh,
                                      read_identity)
from trainer.runtime.reporting import (CHECKPOINT_REPORT_DEADLINE_S, FLUSH_WAIT_S,
                                       AgentReporter)

_log = structlog.get_logger()

__all__ = ["CHECKPOINT_REPORT_DEADLINE_S", "FLUSH_WAIT_S", "MESH_DIM_NAMES", "Identity", "Layout",
           "LayoutError", "Runtime", "claim_fault", "deadline_problems", "env",
           "fault_marker_path", "init", "inside", "job_deadlines", "parse_fault_schedule", "parse_mesh",
           "rank_faults"]


class Runtime:
    """One rank's view of its job. Build it with ``init()``.

    Attributes: ``rank``, ``world_size``, ``local_rank`` (ints), ``generation`` (int, 0
    without Keel), ``job`` (str, "" without Keel), ``mesh`` (dimension → size),
    ``checkpoint_dir`` and ``restore_from`` (absolute paths or None), ``restart_count``
    (int), ``slow_factor`` (float, step-time multiplier from a ``slow`` fault, 1.0 if none).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        generation: int,
        job: str,
        mesh: dict[str, int],
        checkpoint_dir: str | None,
        restore_from: str | None,
        restart_count: int,
        agent_socket: str | None,
        faults: keel_pb2.FaultSchedule,
        restore_fallbacks: tuple[str, ...] = (),
        fence_after_s: float | None = None,
        agent_token: str = "",
        node: str = "",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.generation = generation
        self.job = job
        self.mesh = mesh
        self.checkpoint_dir = checkpoint_dir
        self.restore_from = restore_from
        self.restore_fallbacks = restore_fallbacks
        self.restart_count = restart_count
        self.agent_socket = agent_socket
        under_keel = {"job": job, "generation": generation, "node": node}
        logs.configure("trainer", rank=rank, **{k: v for k, v in under_keel.items() if v})
        self._faults = FaultInjector(faults, rank, generation, self.log)
        self._agent = AgentReporter(agent_socket, rank=rank, world_size=world_size,
                                    generation=generation, job=job, log=self.log,
                                    fence_after_s=fence_after_s,
                                    token=agent_token) if agent_socket else None

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

    def report_step(self, step: int, loss: float, tokens: int, step_time_s: float, *,
                    data_s: float = 0.0, compute_s: float = 0.0, optimizer_s: float = 0.0,
                    checkpoint_s: float = 0.0, checkpointing: bool = False,
                    restore_s: float = 0.0) -> None:
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
            self._agent.report_step(step, loss, tokens, step_time_s, data_s=data_s,
                                    compute_s=compute_s, optimizer_s=optimizer_s,
                                    checkpoint_s=checkpoint_s, checkpointing=checkpointing,
                                    restore_s=restore_s)

    def take_checkpoint_request(self) -> bool:
        """Whether the agent asked for a checkpoint since the last call (cleared by the
        call). Only this rank's own agent connection is seen, so fold the answer into a
        collective before acting on it. False without an agent."""
        return self._agent is not None and self._agent.take_checkpoint_request()

    def report_preflight(self, results: Sequence, wall_s: float) -> bool:
        """Sends this rank's preflight sweep to the agent (``AgentReporter``); whether
        the agent acknowledged. False without an agent."""
        return self._agent is not None and self._agent.report_preflight(results, wall_s)

    def report_checkpoint(self, step: int, path: str, samples: int, *, save_s: float = 0.0,
                          size: int = 0) -> bool:
        """Tells the agent that the checkpoint of step ``step`` is durable at ``path``
        (``samples``: global data position after it; ``save_s``: seconds from the save's
        start to now; ``size``: its bytes); whether the agent acknowledged. False
        without an agent."""
        return self._agent is not None and self._agent.report_checkpoint(
            step, path, samples, save_s=save_s, size=size)

    def report_checkpoint_problem(self, step: int, path: str, kind: str, reason: str) -> bool:
        """Tells the agent of a checkpoint this rank would not or could not use: a
        commit refused because a newer generation owns the directory
        (``"stale_commit"``), or one that failed verification and was renamed aside
        (``"quarantined"``). False without an agent."""
        return self._agent is not None and self._agent.report_checkpoint_problem(
            step, path, kind, reason)

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


def init(environ: Mapping[str, str] | None = None) -> Runtime:
    """Builds this rank's ``Runtime`` from ``environ`` (default ``os.environ``): the
    torchrun variables, ``KEEL_*`` when Keel started the rank. Installs a SIGUSR1
    handler that dumps every thread's Python stack to stderr, for hang diagnosis."""
    environ = os.environ if environ is None else environ
    identity = read_identity(environ)
    # Under Keel, a rank whose agent answers nothing for the collective timeout stops.
    runtime = Runtime(**vars(identity), faults=parse_fault_schedule(environ.get(env.FAULTS)),
                      fence_after_s=job_deadlines(environ).get("collective_timeout_s"))
    # The process's own fd 2, which the agent captures, even when sys.stderr has been
    # swapped for something without a file descriptor.
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    return runtime
