"""The controller's Prometheus metrics (``keel_`` prefix, labels bounded by job count)."""

from prometheus_client import Counter, Gauge, start_http_server

from orchestrator.policy.lifecycle import JobState

LEADER = Gauge("keel_controller_leader", "1 while this controller leads, 0 on standby")
NODES = Gauge("keel_nodes_connected", "Agents connected and registered in etcd")
JOB_STATE = Gauge("keel_job_state", "Job lifecycle state as an index: " + ", ".join(
    f"{index} {state.value}" for index, state in enumerate(JobState)), ["job"])
JOB_GENERATION = Gauge("keel_job_generation", "Current generation of the job", ["job"])
JOB_RESTARTS = Counter("keel_job_restarts", "Generations restarted after a failure", ["job"])
JOB_STEP = Gauge("keel_job_step", "Highest training step reported by rank 0", ["job"])


def serve(port: int) -> None:
    """Serve /metrics on ``port`` (0 picks a free one) from a daemon thread."""
    start_http_server(port)
AGENT_MESSAGES_REFUSED = Counter(
    "keel_agent_messages_refused", "Agent messages refused because the plan does not let "
    "the node say them (see orchestrator.policy.authority)", ["kind"])
