"""Which address a daemon advertises, and which ports it may bind: a daemon on a real
cluster must hand its peers an address they reach, never a loopback one when they are
remote, and take ports a firewall was opened for."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


class AddressError(ValueError):
    pass


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def interface_addresses() -> dict[str, set[str]]:
    """This machine's interfaces (Linux) and the addresses each holds, IPv4 and IPv6."""
    found: dict[str, set[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address
                continue
            found.setdefault(name, set()).add(socket.inet_ntoa(packed[20:24]))
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                found.setdefault(fields[5], set()).add(
                    str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                )
    except OSError:  # no IPv6
        pass
    return found


def interface_of(host: str) -> str | None:
    """The interface that holds ``host`` (an address, or a name resolving to one of
    this machine's), or None when none here does (a NAT's public address)."""
    try:
        wanted = {
            ipaddress.ip_address(info[4][0].split("%")[0]).compressed
            for info in socket.getaddrinfo(host.strip("[]"), None)
        }
    except (OSError, ValueError):
        return None
    for name, addresses in sorted(interface_addresses().items()):
        if wanted & {ipaddress.ip_address(a).compressed for a in addresses}:
            return name
    return None


def route_address(peer: str, port: int) -> str:
    """This machine's address on the route to ``peer``:``port`` (what the peer sees us
    as): the source address the kernel picks for a UDP socket connected there, which
    sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, port))
        return probe.getsockname()[0]


def advertised(given: str | None, etcd_endpoints: tuple[str, ...], flag: str) -> str:
    """The address to advertise: ``given`` (``flag``'s value), else this machine's
    address on the route to the first etcd endpoint. A loopback address is refused
    when etcd, and so the peers, are remote: they could not reach it."""
    host, _, port = etcd_endpoints[0].rpartition(":")
    remote = not is_loopback(host)
    if given:
        if remote and is_loopback(given):
            raise AddressError(
                f"{flag} {given}: etcd is at {etcd_endpoints[0]}, so peers are "
                f"remote and cannot reach a loopback address; give {flag} "
                f"this machine's address on the cluster network"
            )
        return given
    try:
        return route_address(host, int(port))
    except OSError as exc:
        raise AddressError(
            f"cannot tell this machine's address on the route to etcd "
            f"{etcd_endpoints[0]} ({exc}); give {flag}"
        ) from None


def listen_address(listen: str, advertise_host: str) -> str:
    """A ``--listen``-style "[host]:port" as "host:port": a bare port (or ":port") binds
    the address the daemon advertises, not every interface."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{listen!r}: write [HOST]:PORT, e.g. :9400 (port 0 picks a free one)")
    return f"{host or advertise_host}:{port}"


def port_range(text: str) -> range:
    """``"LOW-HIGH"`` (inclusive) as a range of ports; raises ValueError with the fix."""
    low, sep, high = text.partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"port range {text!r}: write LOW-HIGH, e.g. 29500-29599") from None
    if not 0 < first <= last < 65536:
        raise ValueError(f"port range {text!r}: give 1 <= LOW <= HIGH <= 65535")
    return range(first, last + 1)


def free_port(host: str, ports: range | None = None) -> int:
    """A port that was free on ``host`` a moment ago: any (port 0), or the first free
    one of ``ports``. The socket is closed before returning, so the caller binds
    promptly; every caller here does, and fails loudly if it lost the race."""
    for port in ports or (0,):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free port on {host} in {ports.start}-{ports.stop - 1}")
