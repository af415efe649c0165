"""The address a daemon advertises and the ports it takes."""

import socket

import pytest

from common import net


def test_the_route_to_a_local_etcd_is_loopback_and_a_given_address_is_kept():
    assert net.advertised(None, ("127.0.0.1:2379",), "--host") == "127.0.0.1"
    assert net.advertised("10.1.2.3", ("127.0.0.1:2379",), "--host") == "10.1.2.3"
    assert net.advertised(None, ("localhost:2379",), "--host").startswith("127.")


def test_a_loopback_address_is_refused_when_etcd_is_remote():
    with pytest.raises(
        net.AddressError, match="peers are remote and cannot reach a loopback address; give --host"
    ):
        net.advertised("127.0.0.1", ("10.200.0.5:2379",), "--host")
    assert net.advertised("10.200.0.9", ("10.200.0.5:2379",), "--host") == "10.200.0.9"


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("localhost", True),
        ("10.0.0.1", False),
        ("192.168.1.7", False),
    ],
)
def test_loopback_is_told_apart(host, loopback):
    assert net.is_loopback(host) is loopback


def test_port_ranges_parse_or_say_how_to_write_them():
    assert net.port_range("29500-29502") == range(29500, 29503)
    assert net.port_range("7070") == range(7070, 7071)
    for bad in ("29500-", "a-b", "0-10", "20-10", "70000"):
        with pytest.raises(ValueError, match="port range"):
            net.port_range(bad)


def test_a_free_port_is_taken_from_the_range_past_a_busy_one():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = range(taken, taken + 50)
        found = net.free_port("127.0.0.1", ports)
        assert found in ports and found != taken
        with pytest.raises(OSError, match=f"no free port on 127.0.0.1 in {taken}-{taken}"):
            net.free_port("127.0.0.1", range(taken, taken + 1))


def test_a_bare_port_listens_on_the_advertised_host():
    assert net.listen_address(":0", "10.0.0.2") == "10.0.0.2:0"
    assert net.listen_address("0.0.0.0:7070", "10.0.0.2") == "0.0.0.0:7070"


def test_a_malformed_listen_address_is_refused_with_the_form_to_use():
    for bad in ("9400x", "host", ":99999"):
        with pytest.raises(ValueError, match=r"write \[HOST\]:PORT"):
            net.listen_address(bad, "10.0.0.2")


def test_the_interface_of_an_address_is_found_and_a_foreign_one_has_none():
    assert net.interface_of("127.0.0.1") == "lo" and net.interface_of("localhost") == "lo"
    assert "127.0.0.1" in net.interface_addresses()["lo"]
    assert net.interface_of("198.51.100.77") is None
    assert net.interface_of("no-such-host.invalid") is None
