"""Step reports summed up per step: the agent sends its ranks' reports to the
controller as one ``NodeStep`` a step (``summarize``), so that what a message costs the
controller grows with the steps it carries rather than with the node's ranks. Pure."""

from __future__ import annotations

import math

from protos import keel_pb2

# Rank reports one StepReportBatch carries at most (so at most this many NodeSteps, and
# this many ranks over all of them): an agent sends a batch once it holds 4,096 reports
# (agent/reports.py) and never puts more than this in one; the controller refuses a
# larger batch before it takes any lock (orchestrator/policy/authority.batch_refusal).
MAX_BATCH_REPORTS = 16_384


def summarize(reports: list[keel_pb2.StepReport]) -> list[keel_pb2.NodeStep]:
    """The ranks' reports as one ``NodeStep`` per step, in step order (a rank's first
    report of a step counts, as at the controller); then each report a step cannot
    carry (a step below 1, a step time that is not a finite number of seconds) as a
    ``NodeStep`` of its own rank, for the controller to refuse with its warning."""
    by_step: dict[int, dict[int, keel_pb2.StepReport]] = {}
    unfit = []
    for report in reports:
        if not (report.step >= 1 and 0 <= report.step_time_s < math.inf):
            unfit.append(report)
            continue
        by_step.setdefault(report.step, {}).setdefault(report.rank, report)
    node_steps = []
    for step in sorted(by_step):
        ranks = by_step[step]
        order = sorted(ranks)
        node_steps.append(
            keel_pb2.NodeStep(
                step=step,
                ranks=order,
                step_time_s=[ranks[r].step_time_s for r in order],
                tokens=sum(r.tokens for r in ranks.values()),
                at=max(r.at for r in ranks.values()),
                checkpoint_s=max(r.checkpoint_s for r in ranks.values()),
                restore_s=max(r.restore_s for r in ranks.values()),
                loss=ranks[order[0]].loss,
            )
        )
    node_steps.extend(
        keel_pb2.NodeStep(
            step=r.step,
            ranks=[r.rank],
            step_time_s=[r.step_time_s],
            tokens=r.tokens,
            at=r.at,
            checkpoint_s=r.checkpoint_s,
            restore_s=r.restore_s,
            loss=r.loss,
        )
        for r in unfit
    )
    return node_steps
