"""The job lifecycle: states and the only transitions allowed between them."""

from __future__ import annotations

import enum

from common.proto_enums import ProtoEnum
from protos import keel_pb2


class JobState(str, enum.Enum):
    PENDING = "PENDING"  # waiting for enough free slots for the next generation
    STARTING = "STARTING"  # nodes chosen, waiting for the rendezvous endpoint
    RUNNING = "RUNNING"  # plan written to etcd, ranks started
    STOPPING = "STOPPING"  # a generation is being torn down after a failure
    SUCCEEDED = "SUCCEEDED"  # every rank of a generation exited 0
    FAILED = "FAILED"  # restarts exhausted or the spec cannot be run
    CANCELLED = "CANCELLED"  # stopped by an operator

    @property
    def holds_nodes(self) -> bool:
        """A generation is placed on nodes: being started, running, or being stopped."""
        return self in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


# The states on the wire (JobStatus.state); the strings above are what etcd stores and
# operators read.
WIRE_STATES = ProtoEnum(JobState, keel_pb2.JobState, "JOB_STATE_")

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STARTING, JobState.FAILED, JobState.CANCELLED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.STOPPING}),
    JobState.RUNNING: frozenset({JobState.STOPPING, JobState.SUCCEEDED}),
    JobState.STOPPING: frozenset({JobState.PENDING, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: JobState, target: JobState) -> JobState:
    """Return ``target`` if the lifecycle allows ``current -> target``; raise otherwise."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(f"job cannot go from {current.value} to {target.value}")
    return target


def past_retention(state: JobState, ended_at: float | None, now: float, ttl_s: float) -> bool:
    """Whether a job that ended at ``ended_at`` (wall clock) is kept no longer: its
    records go from etcd. ``ttl_s`` 0 keeps ended jobs until they are deleted."""
    return state.terminal and ended_at is not None and ttl_s > 0 and now - ended_at >= ttl_s
