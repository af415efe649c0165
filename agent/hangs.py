"""Hang handling on a node: judge the ranks' progress with ``agent.hang.find_hang``, and
collect every local rank's Python stacks (SIGUSR1: faulthandler dumps all threads to
the rank's stderr) for the report, before the ranks are stopped."""

from __future__ import annotations

import os
import signal
import time

from agent.failure import tail
from agent.hang import Hang, HangConfig, RankProgress, find_hang
from agent.stacks import dump_since, parse_dump, where
from agent.supervisor import RankProcess
from common.wire_kinds import WIRE_HANG_PHASES, HangPhase
from protos import keel_pb2

STACK_DUMP_WAIT_S = 0.5  # faulthandler writes within milliseconds; slack for a busy node
STACK_TAIL_BYTES = 65536


def check(
    now: float,
    ranks: list[RankProcess],
    latest: dict[int, tuple[float, keel_pb2.StepReport]],
    recent_step_times: list[float],
    config: HangConfig,
) -> Hang | None:
    """The hung rank among ``ranks`` (running ones), judged on each rank's latest report
    (``latest``: rank -> when it arrived, the report) and the recent step times."""
    progress = []
    for rank in ranks:
        at, report = latest.get(rank.rank, (None, keel_pb2.StepReport()))
        progress.append(
            RankProgress(
                rank=rank.rank,
                pid=rank.pid,
                started_at=rank.started_at,
                last_report_at=at,
                last_step=report.step,
                checkpointing=report.checkpointing,
                reports_steps=rank.attached,
            )
        )
    return find_hang(now, progress, recent_step_times, config)


def collect_stacks(
    job: str, generation: int, ranks: list[RankProcess], hang: Hang | None
) -> keel_pb2.HangDetected:
    """SIGUSR1 every rank of ``ranks`` (all running), read what each wrote, and make the
    report of ``job``'s ``generation``: the stacks, and the hang if this agent found it.
    Each stack's first line says where its main thread is."""
    before = {r.rank: tail(r.stderr_path, STACK_TAIL_BYTES) for r in ranks}
    for proc in ranks:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_WAIT_S)
    stacks = {}
    for proc in ranks:
        dump = dump_since(before[proc.rank], tail(proc.stderr_path, STACK_TAIL_BYTES))
        stacks[proc.rank] = f"{where(parse_dump(dump)) or 'no stack dumped'}\n{dump.strip()}"
    report = keel_pb2.HangDetected(
        job=job, generation=generation, stacks=stacks, detected_at=time.time()
    )
    if hang is not None:
        report.rank, report.pid, report.last_step = hang.rank, hang.pid, hang.last_step
        report.stalled_for_s, report.timeout_s = hang.stalled_for_s, hang.timeout_s
        report.phase = WIRE_HANG_PHASES.to_wire(HangPhase(hang.phase))
    return report
