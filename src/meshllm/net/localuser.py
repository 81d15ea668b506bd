"""Who is on the other end of a loopback TCP connection: our own user, or another user of this machine.

Loopback servers of ours that act for the user who started mesh-llm (the host's tunnel listeners, which reach the
workers' rpc-servers; the web console, which hands out the invite token) serve that user's processes only. On
Linux the kernel says who owns each socket (/proc/net/tcp, /proc/net/tcp6): the client's socket is the row whose
local address is our connection's peer. Elsewhere nothing is checked (the README says so).
"""

from __future__ import annotations

import asyncio
import os
import socket


def other_user(transport: asyncio.BaseTransport) -> int | None:
    """The uid of the client at the other end of ``transport`` if it is not ours (-1: gone, or not found); None
    when it is ours, or when this cannot be known here."""
    peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not (isinstance(peer, tuple) and isinstance(local, tuple)):
        return None  # not TCP (a Unix socket: its mode decides)
    uid = loopback_peer_uid((peer[0], peer[1]), (local[0], local[1]))
    return None if uid is None or uid == os.getuid() else uid


def loopback_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The user owning the client end (``peer``) of a TCP connection accepted at ``local``; None where that cannot
    be known (no /proc); -1 when the client's socket is not found (it is gone already)."""
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    want = (_proc_addr(family, peer), _proc_addr(family, local))
    try:
        with open("/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        cols = row.split()
        if len(cols) > 7 and (cols[1], cols[2]) == want:
            return int(cols[7])
    return -1


def _proc_addr(family: int, addr: tuple[str, int]) -> str:
    """An address as /proc/net/tcp{,6} writes it: the address in 32-bit words, each little-endian in hex, then
    ':' and the port in hex."""
    raw = socket.inet_pton(family, addr[0].split("%")[0])
    words = "".join(f"{int.from_bytes(raw[i : i + 4], 'little'):08X}" for i in range(0, len(raw), 4))
    return f"{words}:{addr[1]:04X}"
