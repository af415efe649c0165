"""The job lifecycle: the only transitions allowed between its states (``JobState``,
stored with the job in ``common.records``)."""

from __future__ import annotations

from common.proto_enums import ProtoEnum
from common.records import JobState
from protos import keel_pb2

# The states on the wire (JobStatus.state); JobState's strings are what etcd stores and
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
