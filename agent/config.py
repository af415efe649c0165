"""Typed agent configuration, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.etcd_client import EtcdCredentials, host_port
from agent.tls import TlsFiles

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class AgentConfig:
    node: str
    slots: int
    etcd_endpoints: tuple[str, ...]
    token: str = field(repr=False)       # the join token (or the controller's only one)
    run_dir: Path                         # rank logs and error files
    host: str = "127.0.0.1"               # address peers reach this node's ranks on
    controller: str | None = None         # host:port; None = discover through etcd
    lease_ttl_s: float = 5.0              # node record expires this long after death
    tick_s: float = 0.05                  # supervision period (rank exit detection)
    report_flush_s: float = 0.5           # step reports are batched up to this long
    stop_grace_s: float = 5.0             # SIGTERM → SIGKILL
    etcd_timeout_s: float | None = None   # default: lease_ttl_s / 3
    reconnect_max_s: float = 5.0          # back-off cap between controller reconnects
    metrics_port: int | None = None
    tls: TlsFiles | None = None           # mutual TLS to the controller; None = plaintext
    etcd_credentials: EtcdCredentials | None = None  # etcd TLS and/or user/password

    def __post_init__(self):
        if not NODE_NAME.match(self.node):
            raise ValueError(f"node {self.node!r}: use 1-63 letters, digits, '.', '_' or "
                             f"'-', starting with a letter or digit")
        if not 1 <= self.slots <= 1024:
            raise ValueError(f"slots={self.slots}: must be between 1 and 1024")
        if not self.etcd_endpoints:
            raise ValueError("etcd_endpoints: give at least one host:port")
        for endpoint in self.etcd_endpoints:
            host_port(endpoint)
        if not self.token:
            raise ValueError("token: the agent needs the join token (--token-file, "
                             "--tls-dir's join.token, or KEEL_TOKEN)")
        # Deadline hierarchy: lease refresh (ttl/3) < lease TTL; etcd calls must fail
        # well before the lease would lapse; supervision ticks many times per grace.
        if self.lease_ttl_s < 2:
            raise ValueError(f"lease_ttl_s={self.lease_ttl_s}: etcd leases need at least 2 s")
        if self.etcd_timeout_s is None:
            object.__setattr__(self, "etcd_timeout_s", self.lease_ttl_s / 3)
        if self.etcd_timeout_s >= self.lease_ttl_s / 2:
            raise ValueError(f"etcd_timeout_s={self.etcd_timeout_s} must be below "
                             f"lease_ttl_s/2 ({self.lease_ttl_s / 2})")
        if not 0 < self.tick_s <= self.stop_grace_s / 10:
            raise ValueError(f"tick_s={self.tick_s} must be positive and at most "
                             f"stop_grace_s/10")
