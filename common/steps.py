"""Step reports summed up per step: the agent sends its ranks' reports to the
controller as one ``NodeStep`` a step (``summarize``), so that what a message costs the
controller grows with the steps it carries rather than with the node's ranks; the
controller reads reports sent one per rank (an older agent, a test) through the same
function. Pure."""

from __future__ import annotations

import math

from protos import keel_pb2


def summarize(
    reports: list[keel_pb2.StepReport],
) -> tuple[list[keel_pb2.NodeStep], list[keel_pb2.StepReport]]:
    """The ranks' reports as one ``NodeStep`` per step, in step order (a rank's first
    report of a step counts, as at the controller); and the reports a step cannot carry
    (a step below 1, a step time that is not a finite number of seconds), which go as
    they are, for the controller to refuse with its warning."""
    by_step: dict[int, dict[int, keel_pb2.StepReport]] = {}
    unsummed = []
    for report in reports:
        if not (report.step >= 1 and 0 <= report.step_time_s < math.inf):
            unsummed.append(report)
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
    return node_steps, unsummed
