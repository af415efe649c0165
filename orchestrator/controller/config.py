"""Typed controller configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.etcd import EtcdCredentials, host_port
from common.net import listen_address
from common.tls import TlsFiles
from orchestrator.security.auth import Tokens

# Shorter, and an agent would be renewing all the time (its check runs every second).
MIN_CERTIFICATE_LIFETIME_S = 30.0


@dataclass(frozen=True)
class ControllerConfig:
    etcd_endpoints: tuple[str, ...]
    token: str = field(repr=False)  # one token for every role, unless `tokens`
    listen: str = "127.0.0.1:0"  # host:port; port 0 binds a free one
    advertise_host: str = "127.0.0.1"  # how agents and operators reach this controller
    tick_s: float = 0.2  # reconcile period
    etcd_timeout_s: float = 5.0  # deadline of every etcd call
    leader_ttl_s: float = 5.0  # lease on the published controller address
    node_lost_grace_s: float = 10.0  # a node whose stream is down this long is lost
    rendezvous_timeout_s: float = 30.0  # rank 0's agent must publish a port within this
    finished_job_ttl_s: float = 7 * 24 * 3600  # ended jobs' records are kept this long; 0: ever
    metrics_listen: str | None = (
        None  # host:port of /metrics (see common.metrics); None = not served
    )
    metrics_address_file: Path | None = None  # write the metrics host:port here once serving
    finished_job_metrics_s: float = 300.0  # an ended job's series are exported this long
    # Step messages a second the agents send together, about: past it they are asked to
    # batch their step reports for longer (orchestrator.policy.pacing).
    report_messages_per_s: float = 1000.0
    # Peak FLOP/s per accelerator name (substring), over exporter.PEAK_FLOPS, for MFU.
    peak_flops: dict[str, float] = field(default_factory=dict)
    address_file: Path | None = None  # write "host:port" here once serving
    tokens: Tokens | None = None  # per-role tokens (join, operator, reader)
    tls: TlsFiles | None = None  # mutual TLS on the gRPC port; None = plaintext
    etcd_credentials: EtcdCredentials | None = None  # etcd TLS and/or user/password
    # TLS bootstrapping (``orchestrator.controller.bootstrap``): the port agents ask for
    # their own certificates on (None: not served; 0: a free one), the CA key that
    # signs them, whether a node's first request waits for ``keel certs approve``, and
    # how long a node's certificate lasts (its agent renews it at 2/3 of that).
    bootstrap_port: int | None = None
    ca_key: Path | None = None
    approve_agents: bool = False
    agent_certificate_lifetime_s: float = 30 * 24 * 3600.0
    # A Hello over the one certificate every agent shares (it binds no node) is refused
    # unless this says otherwise.
    allow_shared_agent_certificate: bool = False

    def __post_init__(self):
        if not self.etcd_endpoints:
            raise ValueError("etcd_endpoints: give at least one host:port")
        for endpoint in self.etcd_endpoints:
            host_port(endpoint)
        if not self.token and self.tokens is None:
            raise ValueError(
                "token: the controller needs one (--token-file, KEEL_TOKEN, "
                "or the role tokens of --tls-dir)"
            )
        # Deadline hierarchy: a tick must fit many times into every timeout it enforces,
        # and etcd calls must fail before a node is given up on.
        if not 0 < self.tick_s <= self.node_lost_grace_s / 4:
            raise ValueError(
                f"tick_s={self.tick_s} must be positive and at most "
                f"node_lost_grace_s/4 ({self.node_lost_grace_s / 4})"
            )
        if self.etcd_timeout_s >= self.node_lost_grace_s:
            raise ValueError(
                f"etcd_timeout_s={self.etcd_timeout_s} must be below "
                f"node_lost_grace_s={self.node_lost_grace_s}"
            )
        if self.leader_ttl_s < 2 * self.tick_s or self.leader_ttl_s < 2:
            raise ValueError(
                f"leader_ttl_s={self.leader_ttl_s} must be at least 2 s and twice tick_s"
            )
        if self.finished_job_ttl_s < 0:
            raise ValueError(
                f"finished_job_ttl_s={self.finished_job_ttl_s}: give 0 (keep "
                f"ended jobs until `keel delete`) or a positive number of seconds"
            )
        if self.bootstrap_port is not None:
            if self.tls is None or self.ca_key is None:
                raise ValueError(
                    "--bootstrap-port needs mutual TLS (--tls-dir) and the CA's key "
                    "(--ca-key, or ca.key in --tls-dir): it signs agents' certificates"
                )
            if not 0 <= self.bootstrap_port < 65536:
                raise ValueError(f"--bootstrap-port {self.bootstrap_port}: give 0-65535")
        if self.agent_certificate_lifetime_s < MIN_CERTIFICATE_LIFETIME_S:
            raise ValueError(
                f"agent_certificate_lifetime_s={self.agent_certificate_lifetime_s}: give "
                f"at least {MIN_CERTIFICATE_LIFETIME_S:g} s (an agent renews at 2/3 of it)"
            )
        if self.metrics_listen is not None:
            listen_address(self.metrics_listen, self.advertise_host)  # raises with the fix
        if self.finished_job_metrics_s < 0:
            raise ValueError(
                f"finished_job_metrics_s={self.finished_job_metrics_s}: give the "
                f"seconds an ended job's series stay exported (0: none)"
            )
        for name, flops in self.peak_flops.items():
            if not name or not flops > 0:
                raise ValueError(
                    f"peak FLOP/s {name}={flops}: give NAME=FLOPS with a "
                    f"positive number, e.g. H100=989e12"
                )
        if not self.report_messages_per_s > 0:
            raise ValueError(
                f"report_messages_per_s={self.report_messages_per_s}: give the "
                f"step messages a second the agents may send together, e.g. 1000"
            )
        if self.rendezvous_timeout_s <= self.tick_s:
            raise ValueError("rendezvous_timeout_s must be longer than tick_s")
