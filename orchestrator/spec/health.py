"""A job's health settings: the spec's values with the defaults filled in, validated.

Its deadlines (hang floor, first-step and checkpoint budgets, stop grace, the
trainer's collective timeouts) are the job's side of the chain that
``common.deadlines`` resolves and checks; the derived ones are filled in here.
"""

from __future__ import annotations

import math

from common import deadlines
from orchestrator.policy.remediation import WIRE_STRAGGLER_POLICIES, StragglerPolicy
from protos import keel_pb2

DEFAULTS = keel_pb2.HealthSpec(
    straggler_policy=WIRE_STRAGGLER_POLICIES.to_wire(StragglerPolicy.REPLACE),
    # 10 x the median step catches a stalled rank within seconds on a sub-second step;
    # the floor keeps jittery short steps from tripping it.
    hang_floor_s=30.0,
    hang_k=10.0,
    # Start-up (rendezvous, model build, preflight) and checkpoint saves are legitimately
    # slow: they get their own budgets instead of inflating the step timeout.
    first_step_timeout_s=300.0,
    checkpoint_timeout_s=300.0,
    stop_grace_s=5.0,
    # 1.25x: well above the +-10% step-time noise of a healthy cluster, well below the
    # 1.5x+ a throttling GPU or a bad link shows.
    straggler_slowdown=1.25,
    straggler_window=5,
    straggler_patience=2,
    max_replacements_per_hour=4,
)


MAX_STRAGGLER_WINDOW = 100  # steps
MAX_STRAGGLER_PATIENCE = 100  # windows


class InvalidHealth(ValueError):
    pass


def resolve(spec: keel_pb2.HealthSpec) -> keel_pb2.HealthSpec:
    """``spec`` with every zero replaced by its default; raises InvalidHealth."""
    resolved = keel_pb2.HealthSpec()
    resolved.CopyFrom(DEFAULTS)
    for field, value in spec.ListFields():
        setattr(resolved, field.name, value)
    problems = [
        f"{field.name}={value}: must be a finite number"
        for field, value in resolved.ListFields()
        if isinstance(value, float) and not math.isfinite(value)
    ]
    if problems:
        raise InvalidHealth("; ".join(problems))
    try:
        WIRE_STRAGGLER_POLICIES.from_wire(resolved.straggler_policy)
    except ValueError:
        problems.append(
            f"straggler_policy {resolved.straggler_policy}: use one of "
            f"{', '.join(p.value for p in StragglerPolicy)}"
        )
    if resolved.hang_k < 2:
        problems.append(
            f"hang_k={resolved.hang_k}: must be at least 2 (a step twice the median is not a hang)"
        )
    try:
        chain = job_deadlines(resolved)
    except deadlines.DeadlineError as exc:
        problems.extend(exc.problems)
    else:
        resolved.collective_timeout_s = chain.collective_timeout_s
        resolved.startup_timeout_s = chain.startup_timeout_s
    if resolved.straggler_slowdown <= 1.1:
        problems.append(
            f"straggler_slowdown={resolved.straggler_slowdown}: must be above "
            f"1.1 (the detector clears a node below 1.1x)"
        )
    # The detector keeps window x ranks samples and re-sorts them every tick.
    for name, most in (
        ("straggler_window", MAX_STRAGGLER_WINDOW),
        ("straggler_patience", MAX_STRAGGLER_PATIENCE),
    ):
        if getattr(resolved, name) > most:
            problems.append(f"{name}={getattr(resolved, name)}: must be at most {most}")
    if problems:
        raise InvalidHealth("; ".join(problems))
    return resolved


def job_deadlines(health: keel_pb2.HealthSpec, **cluster: float) -> deadlines.Deadlines:
    """The deadline chain of a job with ``health`` (zeros derived), on a cluster whose
    deadlines are ``cluster`` (``node_lost_grace_s``, ``lease_ttl_s``, the agents'
    ``heartbeat_s`` ...; those not given take their defaults). Raises DeadlineError."""
    return deadlines.resolve(
        hang_floor_s=health.hang_floor_s,
        first_step_timeout_s=health.first_step_timeout_s,
        checkpoint_timeout_s=health.checkpoint_timeout_s,
        stop_grace_s=health.stop_grace_s,
        collective_timeout_s=health.collective_timeout_s,
        startup_timeout_s=health.startup_timeout_s,
        **cluster,
    )
