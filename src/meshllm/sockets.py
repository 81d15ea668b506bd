"""Sockets for both IP families. A listener on every interface ("0.0.0.0" or "::", the default) is one IPv6
socket that takes IPv4 too (dual stack): one port, one socket, whatever family a peer uses. On such a socket an IPv4
peer reads as ``::ffff:a.b.c.d``; the endpoint turns that back into the dotted address that tokens, gossip and key
files name (``canonical`` does the same for addresses we are given), and the reverse for a send. A machine without
IPv6 gets an IPv4 socket as before."""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import TypeVar

A = TypeVar("A")

ANY = ("0.0.0.0", "::")
NO_IPV6 = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT)


def is_v6(host: str) -> bool:
    return ":" in host


def canonical(host: str) -> str:
    """An IP literal as the socket calls write it, so addresses compare equal: IPv6 compressed and lower-case
    ("2001:DB8:0::1" -> "2001:db8::1"), an IPv4-mapped one dotted; anything else unchanged."""
    if not is_v6(host):
        return host
    try:
        ip = ipaddress.IPv6Address(host)
    except ValueError:
        return host
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)


def bound(host: str, port: int, kind: socket.SocketKind) -> socket.socket:
    """A socket of ``kind`` (SOCK_DGRAM, SOCK_STREAM) bound to ``host``:``port``; OSError as bind raises it. Every
    interface (``ANY``) is a dual-stack IPv6 socket, or an IPv4 one where the machine has no IPv6."""
    if host in ANY:
        try:
            return _bind(socket.AF_INET6, "::", port, kind, dual=True)
        except OSError as e:
            if e.errno not in NO_IPV6:
                raise
        return _bind(socket.AF_INET, "0.0.0.0", port, kind, dual=False)
    return _bind(socket.AF_INET6 if is_v6(host) else socket.AF_INET, host, port, kind, dual=False)


def _bind(family: socket.AddressFamily, host: str, port: int, kind: socket.SocketKind, dual: bool) -> socket.socket:
    sock = socket.socket(family, kind)
    try:
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


GSO_SEGMENTS = 40  # datagrams per send at most: 40 full QUIC datagrams (~1,450 bytes) stay under UDP's 65,507


def gso_runs(datagrams: list[tuple[bytes, A]]) -> list[tuple[A, list[bytes]]]:
    """Datagrams in order, cut into runs that one UDP GSO send can carry: one address, every datagram the size of
    the first but the last, which may be shorter (the kernel cuts the run at the first one's size), at most
    GSO_SEGMENTS."""
    out: list[tuple[A, list[bytes]]] = []
    for data, addr in datagrams:
        if out:
            at, run = out[-1]
            if at == addr and len(run) < GSO_SEGMENTS and len(data) <= len(run[0]) == len(run[-1]):
                run.append(data)
                continue
        out.append((addr, [data]))
    return out


def host_port(host: str, port: int) -> str:
    """An address as ``proto/token.ip_port`` reads it: "1.2.3.4:5", an IPv6 host in brackets ("[::1]:5")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
