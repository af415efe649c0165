"""The processes of a local cluster: an embedded etcd (unless endpoints are given), the
controllers and the agents, each tied to ``keel up`` by a parent-death signal, started
and stopped in order."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import env
from common.etcd import EtcdCredentials, connect, etcd_flags
from common.keys import local_node
from common.procs import terminate, tied_to_this_process
from common.tls import TlsFiles, resolve_tls
from orchestrator.controller.store import Store
from orchestrator.local import prometheus
from orchestrator.local.etcd_server import EmbeddedEtcd
from orchestrator.local.options import UpOptions
from orchestrator.local.proxy import NodeProxy
from orchestrator.security import etcd_roles, etcd_setup
from orchestrator.security.certs import init_once

SHARED_MEMORY = Path("/dev/shm")
MEMORY_ROOT_PREFIX = "keel-up-"
OWNER_FILE = "owner"  # in a memory root: "<pid> <start time>" of the keel up it is


def _started(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks after boot, /proc/<pid>/stat field 22):
    with the pid, it names the process even after the pid is reused. None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def claim_memory_root(root: Path) -> None:
    """Make ``root`` and mark it this process's, for ``sweep_memory_roots``."""
    root.mkdir(mode=0o711, parents=True)
    (root / OWNER_FILE).write_text(f"{os.getpid()} {_started(os.getpid())}\n")


def sweep_memory_roots(parent: Path = SHARED_MEMORY) -> list[Path]:
    """Remove the memory roots under ``parent`` whose keel up is gone (SIGKILLed, so its
    ``stop`` never ran; a lost node's memory, and a finished job's replicas, would stay
    in /dev/shm until reboot); the ones removed. A root without an owner file is left:
    it may be being made."""
    swept = []
    for root in sorted(parent.glob(f"{MEMORY_ROOT_PREFIX}*")):
        try:
            pid, started = (root / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if pid.isdigit() and _started(int(pid)) == started:
            continue  # its keel up runs
        shutil.rmtree(root, ignore_errors=True)
        swept.append(root)
    return swept


@dataclass
class LocalCluster:
    """The processes of a local cluster, started and stopped in order."""

    options: UpOptions
    workdir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    etcd: EmbeddedEtcd | None = None
    controllers: list[subprocess.Popen] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)  # of each controller, in order
    agents: list[subprocess.Popen] = field(default_factory=list)
    client_tls: TlsFiles | None = None  # keel up's own certificate, with --tls
    etcd_tls: TlsFiles | None = None  # the embedded etcd's, with --tls
    etcd_credentials: EtcdCredentials | None = None  # keel up's own, for etcd
    # Each agent's credential flags, by node index.
    agent_credentials: list[list[str]] = field(default_factory=list)
    etcd_root: EtcdCredentials | None = None  # sets up the embedded etcd's auth, with --tls
    # With proxied: each node's agent reaches etcd and the controllers through a
    # proxy of its own, which partition_node cuts.
    proxied: bool = False
    proxies: list[NodeProxy] = field(default_factory=list)
    # With a memory tier: the simulated nodes' memory, a directory each under this one
    # in /dev/shm. On one machine a lost node's memory outlives it (on a cluster it
    # goes with the node): ``stop`` removes all of it.
    memory_root: Path = field(
        default_factory=lambda: SHARED_MEMORY / f"{MEMORY_ROOT_PREFIX}{secrets.token_hex(6)}"
    )

    @property
    def endpoints(self) -> str:
        return ",".join(self.options.etcd_endpoints) or ",".join(self.etcd.endpoints)

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        """A daemon, ``python ARGS`` plus the log flags, logging to ``logs/LOG_NAME``."""
        args = [
            *args,
            "--log-format",
            self.options.log_format,
            "--log-level",
            self.options.log_level,
        ]
        with open(self.workdir / "logs" / log_name, "ab") as log:
            return subprocess.Popen(
                [*tied_to_this_process(), sys.executable, *args],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _credentials(self) -> tuple[list[str], list[list[str]]]:
        """The controllers' credential flags, and each agent's. Plain: one token for
        everything. With --tls: a CA and certificates in <workdir>/tls (one per node),
        agents given only the join token and keel up itself the operator's; and the
        embedded etcd serves TLS to holders of that CA's certificates only, each party
        presenting its own, and grants each only its keys (``etcd_roles``). Then the
        given etcd's credentials, if any."""
        etcd = etcd_flags(self.options.etcd_credentials)
        self.etcd_credentials = self.options.etcd_credentials
        if self.options.etcd_credentials and self.options.etcd_credentials.password:
            # The daemons inherit it from here: a flag would show in ps.
            os.environ[env.ETCD_PASSWORD] = self.options.etcd_credentials.password
        if not self.options.tls:
            token_file = self.workdir / "token"
            token_file.touch(mode=0o600)
            token_file.write_text(self.token)
            flags = ["--token-file", str(token_file), *etcd]
            return flags, [flags for _ in self._nodes()]
        tls_dir = init_once(self.workdir / "tls", self._nodes())
        self.token = (tls_dir / "operator.token").read_text().strip()
        self.client_tls = resolve_tls(tls_dir, "operator")
        if self.options.etcd_endpoints:
            flags = ["--tls-dir", str(tls_dir), *etcd]
            return flags, [flags for _ in self._nodes()]

        def party(name: str) -> EtcdCredentials:
            return EtcdCredentials(
                ca=tls_dir / "ca.pem", cert=tls_dir / f"{name}.pem", key=tls_dir / f"{name}.key"
            )

        self.etcd_tls = resolve_tls(tls_dir, "controller")
        self.etcd_root = party("root")
        self.etcd_credentials = party("operator")
        return (
            ["--tls-dir", str(tls_dir), *etcd_flags(party("controller"))],
            [
                ["--tls-dir", str(tls_dir), *etcd_flags(party(f"agent-{node}"))]
                for node in self._nodes()
            ],
        )

    def _nodes(self) -> tuple[str, ...]:
        return tuple(local_node(i) for i in range(self.options.nodes + self.options.spares))

    def start(self) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / "prometheus").mkdir(parents=True, exist_ok=True)
        for stale in (self.workdir / "prometheus").glob("*.address"):
            stale.unlink()  # of an earlier run in this workdir
        if self.options.memory_budget_gb:
            swept = sweep_memory_roots()
            if swept:
                print(
                    f"removed the memory of {len(swept)} earlier keel up run(s) that "
                    f"ended without giving it back: {', '.join(str(p) for p in swept)}",
                    file=sys.stderr,
                )
            claim_memory_root(self.memory_root)
        credentials, self.agent_credentials = self._credentials()
        if not self.options.etcd_endpoints:
            self.etcd = EmbeddedEtcd(
                log_path=self.workdir / "logs" / "etcd.log",
                data_parent=self.workdir,
                die_with_parent=True,
                tls=self.etcd_tls,
                members=self.options.etcd_members,
            ).start()
            if self.etcd_root is not None:
                root = connect(self.etcd.endpoints, 5.0, self.etcd_root)
                try:
                    etcd_setup.apply(root, etcd_roles.roles(self._nodes()))
                finally:
                    root.close()
        for i in range(self.options.controllers):
            address_file = self.workdir / f"controller-{i}.address"
            address_file.unlink(missing_ok=True)
            log_name = "controller.log" if i == 0 else f"controller-{i}.log"
            controller = self._spawn(
                [
                    "-m",
                    "orchestrator.cli",
                    "controller",
                    "--etcd-endpoints",
                    self.endpoints,
                    *credentials,
                    "--address-file",
                    str(address_file),
                    "--metrics-listen",
                    ":0",
                    "--metrics-address-file",
                    str(self._metrics_file(f"controller-{i}")),
                ],
                log_name,
            )
            self.controllers.append(controller)
            deadline = time.monotonic() + 30
            while not address_file.exists():
                if controller.poll() is not None:
                    raise RuntimeError(
                        f"controller exited with code {controller.returncode}; "
                        f"see {self.workdir / 'logs' / log_name}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError("controller did not start within 30 s")
                time.sleep(0.05)
            self.addresses.append(address_file.read_text().strip())
        if self.proxied:
            store = Store(connect(self.endpoints.split(","), 2.0, self.etcd_credentials))
            for _ in range(self.options.nodes + self.options.spares):
                self.proxies.append(
                    NodeProxy(self.endpoints.split(",")[0], lambda: _leader_address(store))
                )
        for i in range(self.options.nodes + self.options.spares):
            self.agents.append(self.start_agent(i))

    def start_agent(self, index: int) -> subprocess.Popen:
        """Agent ``node-INDEX``, on its run directory (a restarted one finds there what
        its predecessor left running)."""
        reach = (
            [
                "--etcd-endpoints",
                self.proxies[index].etcd_endpoint,
                "--controller",
                self.proxies[index].controller,
            ]
            if self.proxies
            else ["--etcd-endpoints", self.endpoints]
        )
        return self._spawn(
            [
                "-m",
                "agent",
                "--node",
                local_node(index),
                "--slots",
                str(self.options.slots_per_node),
                *reach,
                *self.agent_credentials[index],
                "--run-dir",
                str(self.workdir / "nodes" / f"node-{index}"),
                "--lease-ttl-s",
                str(self.options.lease_ttl_s),
                "--stop-grace-s",
                str(self.options.stop_grace_s),
                "--metrics-listen",
                ":0",
                "--metrics-address-file",
                str(self._metrics_file(f"agent-node-{index}")),
                *(["--rank-user", self.options.rank_user] if self.options.rank_user else []),
                *(
                    [
                        *("--memory-budget-gb", f"{self.options.memory_budget_gb:g}"),
                        *("--memory-dir", str(self.memory_root / local_node(index))),
                        *(
                            ["--replication-mbps", f"{self.options.replication_mbps:g}"]
                            if self.options.replication_mbps is not None
                            else []
                        ),
                    ]
                    if self.options.memory_budget_gb
                    else []
                ),
                *(["--warm-fill", self.options.warm_fill] if self.options.warm_fill else []),
                *(
                    ["--failure-domain", self.options.failure_domains[index]]
                    if self.options.failure_domains
                    else []
                ),
            ],
            f"agent-node-{index}.log",
        )

    def _metrics_file(self, daemon: str) -> Path:
        return self.workdir / "prometheus" / f"{daemon}.address"

    def write_prometheus(self) -> Path:
        """Write ``prometheus.yml`` and the targets (see ``orchestrator.local.prometheus``);
        the config's path."""
        self.refresh_targets()
        return prometheus.write_config(self.workdir / "prometheus", self.client_tls)

    def refresh_targets(self) -> None:
        """Rewrite the targets if a daemon's metrics address changed (an agent
        restarted); a daemon not serving yet is added once it is."""

        def read(daemon: str) -> list[str]:
            path = self._metrics_file(daemon)
            return [path.read_text().strip()] if path.exists() else []

        prometheus.write_targets(
            self.workdir / "prometheus",
            [a for i in range(len(self.controllers)) for a in read(f"controller-{i}")],
            [a for i in range(len(self.agents)) for a in read(f"agent-node-{i}")],
        )

    def stop(self) -> None:
        """Agents first (they stop their ranks: SIGINT, at once, where SIGTERM would
        drain their nodes), then the controller, then etcd."""
        grace = self.options.stop_grace_s + 5
        terminate(self.agents, grace, signal.SIGINT)
        terminate(self.controllers, grace)
        for proxy in self.proxies:
            proxy.close()
        if self.etcd is not None:
            self.etcd.stop()
        shutil.rmtree(self.memory_root, ignore_errors=True)


def _leader_address(store: Store) -> str | None:
    try:
        return store.controller_address()
    except Exception:  # etcd out of reach: the connection is refused, and retried
        return None
