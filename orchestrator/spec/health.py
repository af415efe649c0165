"""A job's health settings: the spec's values with the defaults filled in, validated.

The deadlines form a hierarchy that is checked here: the hang floor must exceed the
agents' report flush period many times over, and the first-step and checkpoint budgets
must be at least the floor.
"""

from __future__ import annotations

import math

from protos import keel_pb2

POLICIES = ("replace", "exclude", "alert")

DEFAULTS = keel_pb2.HealthSpec(
    straggler_policy="replace",
    # 10 x the median step catches a stalled rank within seconds on a sub-second step;
    # the floor keeps jittery short steps from tripping it.
    hang_floor_s=30.0, hang_k=10.0,
    # Start-up (rendezvous, model build, preflight) and checkpoint saves are legitimately
    # slow: they get their own budgets instead of inflating the step timeout.
    first_step_timeout_s=300.0, checkpoint_timeout_s=300.0,
    # 1.25x: well above the +-10% step-time noise of a healthy cluster, well below the
    # 1.5x+ a throttling GPU or a bad link shows.
    straggler_slowdown=1.25, straggler_window=5, straggler_patience=2,
    max_replacements_per_hour=4)


MAX_STRAGGLER_WINDOW = 100      # steps
MAX_STRAGGLER_PATIENCE = 100    # windows


class InvalidHealth(ValueError):
    pass


def resolve(spec: keel_pb2.HealthSpec) -> keel_pb2.HealthSpec:
    """``spec`` with every zero replaced by its default; raises InvalidHealth."""
    resolved = keel_pb2.HealthSpec()
    resolved.CopyFrom(DEFAULTS)
    for field, value in spec.ListFields():
        setattr(resolved, field.name, value)
    problems = [f"{field.name}={value}: must be a finite number"
                for field, value in resolved.ListFields()
                if isinstance(value, float) and not math.isfinite(value)]
    if problems:
        raise InvalidHealth("; ".join(problems))
    if resolved.straggler_policy not in POLICIES:
        problems.append(f"straggler_policy {resolved.straggler_policy!r}: use one of "
                        f"{', '.join(POLICIES)}")
    if resolved.hang_floor_s < 1:
        problems.append(f"hang_floor_s={resolved.hang_floor_s}: must be at least 1 s, "
                        f"well above the agent's report flush period")
    if resolved.hang_k < 2:
        problems.append(f"hang_k={resolved.hang_k}: must be at least 2 (a step twice the "
                        f"median is not a hang)")
    for name in ("first_step_timeout_s", "checkpoint_timeout_s"):
        if getattr(resolved, name) < resolved.hang_floor_s:
            problems.append(f"{name}={getattr(resolved, name)}: must be at least "
                            f"hang_floor_s={resolved.hang_floor_s}")
    if resolved.straggler_slowdown <= 1.1:
        problems.append(f"straggler_slowdown={resolved.straggler_slowdown}: must be above "
                        f"1.1 (the detector clears a node below 1.1x)")
    # The detector keeps window x ranks samples and re-sorts them every tick.
    for name, most in (("straggler_window", MAX_STRAGGLER_WINDOW),
                       ("straggler_patience", MAX_STRAGGLER_PATIENCE)):
        if getattr(resolved, name) > most:
            problems.append(f"{name}={getattr(resolved, name)}: must be at most {most}")
    if problems:
        raise InvalidHealth("; ".join(problems))
    return resolved
