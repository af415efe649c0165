"""Separate hosts on this machine: one Linux network namespace per host, each with
its own address on a private /24, all joined by a bridge in the root namespace (which
holds the subnet's first address, so the test itself reaches every host as an
operator's machine would).

Names carry a random per-run id, so runs side by side, or the leftovers of one that
was killed, do not collide; the subnet is the first free ``10.213.X.0/24``, chosen
under a lock, so two runs never share one. ``Network.teardown`` kills whatever still runs in
the namespaces and removes the namespaces, the veth pairs and the bridge, whatever
state the test left them in.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUBNETS = ipaddress.ip_network("10.213.0.0/16")
LOCK = Path("/run/keel-test-netns.lock")
# Inside its namespace every host's link has this one name, as eth0 is on real hosts:
# a setting that names the interface (GLOO_SOCKET_IFNAME) is then the same everywhere.
IFNAME = "keel0"


class Unavailable(Exception):
    """Network namespaces cannot be made here; the message says why."""


@dataclass(frozen=True)
class Host:
    name: str  # what the test calls it: "etcd", "node-1"
    netns: str  # its namespace
    ip: str  # its one address
    veth: str  # its link's end in the root namespace (what cut() deletes)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _check_possible() -> None:
    if os.geteuid() != 0:
        raise Unavailable("creating network namespaces needs root")
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command (iproute2) is not on PATH")


class Network:
    """Hosts named ``names`` (addresses from the subnet's .2 on, in that order), alive
    between ``create()`` and ``teardown()``; ``hosts`` maps each name to its Host."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.run_id = secrets.token_hex(3)
        self.hosts: dict[str, Host] = {}
        self.gateway = ""  # the bridge's address: how the root namespace is seen
        self.procs: list[subprocess.Popen] = []
        self._netns_made: list[str] = []
        self._links_made: list[str] = []

    @property
    def bridge(self) -> str:
        return f"kb{self.run_id}"

    def create(self) -> Network:
        """Make the bridge and every host; raises Unavailable (and leaves nothing
        behind) if this machine does not allow it."""
        _check_possible()
        probe = f"keel-{self.run_id}-probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            raise Unavailable(f"`ip netns add` failed: {made.stderr.strip()}")
        _ip("netns", "del", probe, check=False)
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def _create(self) -> None:
        with open(LOCK, "a") as lock:
            # Held until the bridge has its address: another run then sees the subnet taken.
            fcntl.flock(lock, fcntl.LOCK_EX)
            subnet = self._free_subnet()
            addresses = list(subnet.hosts())
            self.gateway = str(addresses[0])
            # Bridged frames skip iptables here, whatever br_netfilter says for the machine.
            _ip("link", "add", self.bridge, "type", "bridge", "nf_call_iptables", "0")
            self._links_made.append(self.bridge)
            _ip("addr", "add", f"{self.gateway}/{subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for index, name in enumerate(self.names):
            host = Host(
                name,
                f"keel-{self.run_id}-{name}",
                str(addresses[index + 1]),
                f"kv{self.run_id}{index}",
            )
            _ip("netns", "add", host.netns)
            self._netns_made.append(host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip(
                "link",
                "add",
                host.veth,
                "type",
                "veth",
                "peer",
                "name",
                IFNAME,
                "netns",
                host.netns,
            )
            self._links_made.append(host.veth)
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/{subnet.prefixlen}", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")
            self.hosts[name] = host

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """The first /24 of SUBNETS that no address or route of this machine touches."""
        used = []
        for listing in (
            _ip("-4", "-o", "addr", "show").stdout,
            _ip("-4", "route", "show", "table", "all").stdout,
        ):
            for word in listing.split():
                try:
                    used.append(ipaddress.ip_network(word, strict=False))
                except ValueError:
                    continue
        for subnet in SUBNETS.subnets(new_prefix=24):
            if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
                return subnet
        raise Unavailable(f"every /24 of {SUBNETS} is in use on this machine")

    def popen(
        self,
        host: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """``argv`` run on ``host`` (``ip netns exec`` execs it: the Popen is the
        process itself), in a session of its own, logging to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[host].netns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def cut(self, host: str) -> None:
        """Lose ``host`` to a partition: delete its link (both ends of the veth pair).
        What runs there keeps running, and reaches nothing but itself."""
        _ip("link", "del", self.hosts[host].veth)
        self._links_made.remove(self.hosts[host].veth)

    def pids(self, host: str) -> list[int]:
        """Every process running in ``host``'s namespace."""
        listed = _ip("netns", "pids", self.hosts[host].netns, check=False).stdout
        return [int(pid) for pid in listed.split()]

    def teardown(self) -> None:
        """SIGKILL what is left in the namespaces, then delete them, the veths and the
        bridge. Safe to call more than once, and after a partial create()."""
        for netns in self._netns_made:
            listed = _ip("netns", "pids", netns, check=False).stdout
            for pid in listed.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for netns in reversed(self._netns_made):
            _ip("netns", "del", netns, check=False)
        self._netns_made.clear()
        for link in reversed(self._links_made):
            _ip("link", "del", link, check=False)
        self._links_made.clear()


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket that process ``pid`` listens on (IPv4
    and IPv6; an IPv4-mapped IPv6 address as IPv4), from its descriptors and its
    namespace's ``/proc/PID/net/tcp*``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            address = ipaddress.ip_address(
                b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            )
            # An IPv6 socket bound to an IPv4 address (as gRPC binds) lists it mapped.
            address = getattr(address, "ipv4_mapped", None) or address
            found.append((str(address), int(hex_port, 16)))
    return found
