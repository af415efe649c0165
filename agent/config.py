"""Typed agent configuration, validated on construction, and the agent's security
settings from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.rank_user import RankUser
from common import deadlines
from common.env import WARM_FILLS
from common.etcd import EtcdCredentials, etcd_credentials, host_port
from common.keys import NODE_NAME, NODE_NAME_RULE
from common.net import listen_address
from common.tls import TlsFiles, first_identity, read_token, resolve_tls


@dataclass(frozen=True)
class AgentConfig:
    node: str
    slots: int
    etcd_endpoints: tuple[str, ...]
    token: str = field(repr=False)  # the join token (or the controller's only one)
    run_dir: Path  # rank logs and error files
    host: str = "127.0.0.1"  # address peers reach this node's ranks on
    rendezvous_ports: range | None = None  # rank 0's rendezvous port from these; None = any
    controller: str | None = None  # host:port; None = discover through etcd
    lease_ttl_s: float = 5.0  # node record expires this long after death
    tick_s: float = 0.05  # supervision period (rank exit detection)
    report_flush_s: float = 0.5  # step reports are batched up to this long
    stop_grace_s: float = 5.0  # SIGTERM → SIGKILL
    drain_timeout_s: float = 60.0  # on SIGTERM: at most this long moving the job off
    etcd_timeout_s: float | None = None  # default: common.deadlines.lease_call_timeout_s
    reconnect_max_s: float = 5.0  # back-off cap between controller reconnects
    metrics_listen: str | None = None  # [host]:port of /metrics; a bare :port binds `host`
    metrics_address_file: Path | None = None  # write the metrics host:port here once serving
    accelerator: str = ""  # what its slots are; "" = detect (agent.accelerator)
    warm_processes: bool = True  # keep a warm process per slot (agent.pool)
    # eager: filled at start and right after each one is taken; lazy: once ranks have
    # started here and run for warm_refill_delay_s (a job's first generation is cold).
    warm_fill: str = "eager"
    warm_refill_delay_s: float = 10.0  # lazy: refill this long after the last rank start
    warm_imports: tuple[str, ...] = ()  # modules they import ahead; () = agent.warm's default
    restart_in_place: bool = True  # keep ranks that can restart in place (agent.parking)
    tls: TlsFiles | None = None  # mutual TLS to the controller; None = plaintext
    etcd_credentials: EtcdCredentials | None = None  # etcd TLS and/or user/password
    rank_user: RankUser | None = None  # ranks run as this user; None = as the agent's
    memory_budget_bytes: int = 0  # memory for a job's snapshots (agent.memory); 0 = none
    memory_dir: Path | None = None  # where it is held; None = agent.memory.default_root
    # Its AgentPeer service ([host]:port; a bare :port binds `host`), which other agents
    # send the copies of their snapshots to and fetch them from (agent.peer); served
    # when memory is held.
    peer_listen: str = ":0"
    replication_mbps: float = 8000.0  # copies to the partner at most this fast; 0 = unbounded
    failure_domain: str = ""  # a rack, a power feed: partners are chosen outside it
    # What the rank user must not be able to read (the agent refuses to start if it can).
    secret_files: tuple[Path, ...] = ()

    def __post_init__(self):
        if not NODE_NAME.match(self.node):
            raise ValueError(f"node {self.node!r}: {NODE_NAME_RULE}")
        if not 1 <= self.slots <= 1024:
            raise ValueError(f"slots={self.slots}: must be between 1 and 1024")
        if not self.etcd_endpoints:
            raise ValueError("etcd_endpoints: give at least one host:port")
        for endpoint in self.etcd_endpoints:
            host_port(endpoint)
        if not self.token:
            raise ValueError(
                "token: the agent needs the join token (--token-file, "
                "--tls-dir's join.token, or KEEL_TOKEN)"
            )
        # Deadline hierarchy: the lease is refreshed on etcd calls of etcd_timeout_s, and
        # a refresh that stalls on one member and its retry on another must fit in the
        # TTL (common.deadlines); supervision ticks many times per grace.
        if self.lease_ttl_s < deadlines.MIN_LEASE_S:
            raise ValueError(f"lease_ttl_s={self.lease_ttl_s}: etcd leases need at least 2 s")
        if self.etcd_timeout_s is None:
            object.__setattr__(
                self, "etcd_timeout_s", deadlines.lease_call_timeout_s(self.lease_ttl_s)
            )
        ttl_s, call_s = self.lease_ttl_s, self.etcd_timeout_s
        problems = deadlines.lease_path_problems("lease_ttl_s", ttl_s, call_s)
        if problems:
            raise ValueError(problems[0])
        if self.metrics_listen is not None:
            listen_address(self.metrics_listen, self.host)  # raises with the fix
        if self.warm_fill not in WARM_FILLS:
            raise ValueError(
                f"warm_fill={self.warm_fill!r}: must be one of {', '.join(WARM_FILLS)}"
            )
        if not self.warm_refill_delay_s >= 0:
            raise ValueError(
                f"warm_refill_delay_s={self.warm_refill_delay_s}: must be 0 or more seconds"
            )
        if not self.drain_timeout_s > 0:
            raise ValueError(
                f"drain_timeout_s={self.drain_timeout_s}: give the seconds a "
                f"SIGTERM may spend moving the job off the node (e.g. 60)"
            )
        if self.memory_budget_bytes < 0:
            raise ValueError(
                f"memory_budget_bytes={self.memory_budget_bytes}: give 0 (no memory tier) "
                "or the bytes a job's snapshots may take on this node"
            )
        if self.memory_budget_bytes:
            listen_address(self.peer_listen, self.host)  # raises with the fix
        if not self.replication_mbps >= 0:
            raise ValueError(
                f"replication_mbps={self.replication_mbps}: give the megabits per second "
                "a snapshot's copy may take to the partner node, or 0 for no bound"
            )
        if not 0 < self.tick_s <= self.stop_grace_s / 10:
            raise ValueError(f"tick_s={self.tick_s} must be positive and at most stop_grace_s/10")


def security_settings(
    node: str,
    token_file: str | None,
    tls_dir: str | None = None,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    **etcd_flags,
) -> dict:
    """``AgentConfig`` fields (token, tls, etcd_credentials, secret_files) from the
    agent's flags.

    From a TLS directory the agent takes ``ca.pem``, its own certificate
    ``agent-<node>.pem``/``.key`` if there is one, else the shared ``agent.pem``/``.key``,
    and ``join.token``. Explicit flags win over the directory; ``KEEL_TOKEN`` is the last
    resort for the token."""
    identity = None
    if tls_dir:
        identity = first_identity(tls_dir, (f"agent-{node}", "agent"))
        if identity is None and not cert:
            raise ValueError(
                f"--tls-dir {tls_dir} holds neither agent-{node}.pem nor "
                f"agent.pem; give --cert and --key"
            )
    tls = resolve_tls(tls_dir, identity, ca, cert, key)
    credentials = etcd_credentials(**etcd_flags)
    # Every credential the agent is given, and every other one in its TLS directory
    # (the CA's key, the operator's): a rank user must read none of them.
    secrets = [token_file, tls.key if tls else None, credentials.key if credentials else None]
    if tls_dir:
        secrets += sorted(Path(tls_dir).glob("*.key")) + sorted(Path(tls_dir).glob("*.token"))
    return {
        "token": read_token(token_file, Path(tls_dir) / "join.token" if tls_dir else None),
        "tls": tls,
        "etcd_credentials": credentials,
        "secret_files": tuple(dict.fromkeys(Path(p).resolve() for p in secrets if p)),
    }
