"""How long agents batch their step reports: long enough that the controller takes
about the same number of step messages a second however many agents it serves. Pure.

Each message costs the controller the same whatever it carries (gRPC's read, a hop to
the thread that records it, the state lock; docs/BENCHMARKS.md has the figure); each
report in it costs a little. An agent batches at its own pace (0.5 s) in a small
cluster; past ``messages_per_s / 2`` agents it is asked to batch for longer. Rank
exits, checkpoints and status go at once whatever the pace, and a hang is judged by
the agent itself: a longer batch delays only what the controller shows (the step,
tokens/s) and the straggler verdict, by at most one interval."""

from __future__ import annotations

# 0: the agent's own pace. Powers of two, so that a cluster that grows through a
# connect storm is told a new interval only a few times.
REPORT_INTERVALS_S = (0.0, 1.0, 2.0, 4.0, 8.0)
AGENT_PACE_S = 0.5  # the agent's own batching (agent.config report_flush_s)
LOWER_MARGIN = 0.8  # lower the interval only with this much room to spare


def report_interval_s(agents: int, messages_per_s: float, current: float) -> float:
    """The interval to ask ``agents`` agents for: the shortest in ``REPORT_INTERVALS_S``
    at which they send at most ``messages_per_s`` step messages a second together (the
    longest if none does). ``current`` is the interval they were asked for: a shorter
    one is taken only once it fits with ``LOWER_MARGIN`` to spare, so that a cluster
    hovering at a boundary is not told a new interval every tick (each change is a
    message to every agent)."""
    if messages_per_s <= 0:
        raise ValueError(
            f"messages_per_s={messages_per_s}: give the step messages a "
            f"second the controller should take, e.g. 1000"
        )
    needed_s = agents / messages_per_s  # each agent's interval at the budget

    def pace(interval_s: float) -> float:
        return interval_s or AGENT_PACE_S

    wanted = next((i for i in REPORT_INTERVALS_S if pace(i) >= needed_s), REPORT_INTERVALS_S[-1])
    if pace(wanted) < pace(current) and needed_s > LOWER_MARGIN * pace(wanted):
        return current
    return wanted
