"""The agent's Prometheus metrics (``keel_agent_`` prefix, bounded labels)."""

from prometheus_client import Counter, Gauge, start_http_server

RANKS_RUNNING = Gauge("keel_agent_ranks_running", "Rank processes alive on this node")
RANK_EXITS = Counter("keel_agent_rank_exits", "Rank process exits", ["outcome"])


def serve(port: int) -> None:
    """Serve /metrics on ``port`` from a daemon thread."""
    start_http_server(port)
