"""One socket for both IP families, and the address forms on it; runs of datagrams that
one segmented (GSO) send carries."""

from __future__ import annotations

import errno
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshllm import sockets
from meshllm.net.endpoint import parse_addr
from meshllm.proto import token as tok


def _has_ipv6() -> bool:
    try:
        sockets.bound("::1", 0, socket.SOCK_DGRAM).close()
    except OSError:
        return False
    return True


def test_addresses_read_the_same_whichever_family_carried_them() -> None:
    assert sockets.canonical("::ffff:192.168.1.2") == "192.168.1.2" and sockets.canonical("10.0.0.1") == "10.0.0.1"
    assert sockets.canonical("2001:DB8:0:0::1") == "2001:db8::1" and sockets.canonical("::ffff:10.0.0.1") == "10.0.0.1"
    assert parse_addr("[2001:DB8:0::1]:7000") == ("2001:db8::1", 7000)  # as a datagram from there reads
    assert sockets.host_port("2001:db8::1", 5) == "[2001:db8::1]:5" and sockets.host_port("10.0.0.1", 5) == "10.0.0.1:5"
    for a in ("[2001:db8::1]:5", "10.0.0.1:5"):
        assert tok.ip_port(a)


@pytest.mark.skipif(not _has_ipv6(), reason="this machine has no IPv6")
def test_every_interface_is_one_port_for_ipv4_and_ipv6() -> None:
    with sockets.bound("0.0.0.0", 0, socket.SOCK_DGRAM) as s:
        assert s.family == socket.AF_INET6
        port = s.getsockname()[1]
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family, socket.SOCK_DGRAM) as c:
                c.sendto(host.encode(), (host, port))
                data, src = s.recvfrom(100)
                assert data == host.encode() and sockets.canonical(src[0]) == host
    with sockets.bound("::", 0, socket.SOCK_STREAM) as t:
        port = t.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as v4, pytest.raises(OSError):
            v4.bind(("0.0.0.0", port))  # IPv4 holds that port too: it is one socket


def test_a_machine_without_ipv6_gets_an_ipv4_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.socket

    def no_v6(family: int = socket.AF_INET, *a: object) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(sockets.socket, "socket", no_v6)
    with sockets.bound("0.0.0.0", 0, socket.SOCK_DGRAM) as s:
        assert s.family == socket.AF_INET and s.getsockname()[0] == "0.0.0.0"
    with pytest.raises(OSError):
        sockets.bound("::1", 0, socket.SOCK_DGRAM)  # asked for IPv6 by name: no quiet fallback


@given(st.lists(st.tuples(st.integers(1, 1500), st.sampled_from(["a", "b"])), max_size=120))
def test_gso_runs_keep_order_and_hold_what_one_segmented_send_can(items: list[tuple[int, str]]) -> None:
    datagrams = [(bytes([i % 251]) * size, addr) for i, (size, addr) in enumerate(items)]
    runs = sockets.gso_runs(datagrams)
    assert [(d, a) for a, run in runs for d in run] == datagrams  # every datagram, in order, to its address
    for _addr, run in runs:
        assert 1 <= len(run) <= sockets.GSO_SEGMENTS
        assert all(len(d) == len(run[0]) for d in run[:-1]) and len(run[-1]) <= len(run[0])
    full = [(b"x" * 1400, "a")] * 100 + [(b"y" * 90, "a")]
    assert [len(r) for _, r in sockets.gso_runs(full)] == [40, 40, 21]  # as few sends as the limit allows
