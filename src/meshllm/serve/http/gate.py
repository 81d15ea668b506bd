"""Connections to the API before any key is checked: bounded per client and in all, and each must send a request's
headers within a deadline (slowloris). The API key is checked once the headers are in, so without this a client that
never finished a request could hold every file descriptor of the node: 1,100 half-sent requests once kept a client
with the key out for 80 s and grew the node by 208 MB.

A client is not an address: thirteen addresses of one IPv6 /64 held all 768 connections and a client
with the key got 0 of 29 requests through. ``client_of`` names a client by its network — an IPv6 /64, an IPv4 /24 —
and on loopback by the local user that owns the socket. And a full gate does not turn the newcomer away: it closes
the oldest connection that has not yet sent a request past the key check (``proven``), so a connection that
presents a valid key always gets in, however many half-sent ones a stranger holds.

``ConnLimits`` decides (pure: counts, no I/O, no clock); ``Gate`` is the thin asyncio shell between the listening
socket and aiohttp's own protocol, which it passes every byte to unchanged.
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from meshllm.net.localuser import loopback_peer_uid

PER_ADDRESS = 64  # connections one client (network or local user) may hold open at once
TOTAL = 768  # connections in all (kept under the file limit: see raise_file_limit)
HEADERS_S = 10.0  # from connecting, or from the first byte of a later request, to that request's whole head


def client_of(address: str, uid: int | None = None) -> str:
    """Who a connection from ``address`` counts as: ``uid`` (the local user owning a loopback client's socket,
    where known) on loopback, the /64 of an IPv6 address, the /24 of an IPv4 one (an IPv4-mapped IPv6 address is its
    IPv4 one); the text itself when it is no address."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return f"local user {uid}" if uid is not None and uid >= 0 else "local"
    bits = 64 if ip.version == 6 else 24
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


@dataclass
class ConnLimits:
    per_address: int = PER_ADDRESS  # per client (``client_of``)
    total: int = TOTAL
    open: dict[str, int] = field(default_factory=dict)  # client -> connections
    owner: dict[object, str] = field(default_factory=dict)  # connection -> its client
    unproven: OrderedDict[object, None] = field(default_factory=OrderedDict)  # none past the key yet, oldest first

    def admit(self, conn: object, client: str) -> tuple[bool, object | None]:
        """Whether a new connection ``conn`` from ``client`` may be served (counted when it may), and the
        connection to close to make room for it: its client's oldest unproven one when that client is at its share,
        else the oldest unproven one of all when the gate is full. Refused only when nothing can go."""
        victim: object | None = None
        if self.open.get(client, 0) >= self.per_address:
            victim = next((c for c in self.unproven if self.owner.get(c) == client), None)
        elif sum(self.open.values()) >= self.total:
            victim = next(iter(self.unproven), None)
        else:
            victim = False  # room: nothing goes
        if victim is None:
            return False, None
        if victim is not False:
            self.release(victim)
        self.owner[conn] = client
        self.open[client] = self.open.get(client, 0) + 1
        self.unproven[conn] = None
        return True, victim if victim is not False else None

    def proven(self, conn: object) -> None:
        """``conn`` sent a request past the key check: never closed to make room."""
        self.unproven.pop(conn, None)

    def release(self, conn: object) -> None:
        """``conn`` is gone (or closed to make room): once only, however often said."""
        client = self.owner.pop(conn, None)
        self.unproven.pop(conn, None)
        if client is None:
            return
        n = self.open.get(client, 0) - 1
        if n > 0:
            self.open[client] = n
        else:
            self.open.pop(client, None)


def raise_file_limit(want: int = 4096) -> int:
    """The soft limit on open files raised toward ``want`` (within the hard limit): the connections the API keeps
    (TOTAL) and the mesh's own sockets and children need room. The limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class Gate(asyncio.Protocol):
    """One client connection: refused at once over the limits; closed when a request head does not arrive within
    HEADERS_S of the connection (the first) or of its first byte (a later one on a kept-alive connection: an idle
    one is aiohttp's to close, gracefully); the API calls ``started``/``finished`` around each request it serves.
    aiohttp's own protocol (``inner``) gets every call unchanged."""

    def __init__(self, limits: ConnLimits, inner: asyncio.Protocol, gates: dict[object, Gate],
                 headers_s: float = HEADERS_S) -> None:  # fmt: skip
        self.limits = limits
        self.inner = inner
        self.gates = gates  # transport -> gate: how the API's middleware finds the gate of a request
        self.headers_s = headers_s
        self.address: str | None = None
        self.client = ""  # who it counts as (``client_of``)
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        address = str(peer[0]) if isinstance(peer, tuple) else ""
        uid = None
        if isinstance(peer, tuple) and isinstance(local, tuple) and client_of(address) == "local":
            uid = loopback_peer_uid((peer[0], peer[1]), (local[0], local[1]))
        client = client_of(address, uid)
        ok, victim = self.limits.admit(self, client)
        if not ok:
            transport.abort()
            return
        if isinstance(victim, Gate) and victim.transport is not None:
            victim.transport.abort()  # the oldest that never got past the key: room for this one
        self.address, self.transport, self.client = address, transport, client
        self.gates[transport] = self
        self._arm()
        self.inner.connection_made(transport)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(self.headers_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def started(self) -> None:
        """A request's head arrived (the API's first middleware runs)."""
        self._in_request = True
        self._disarm()

    def proven(self) -> None:
        """A request of this connection passed the key check (or needed none): it keeps its place."""
        self.limits.proven(self)

    def finished(self) -> None:
        """Its answer went out: the next request's head is timed from its first byte."""
        self._in_request = False

    def data_received(self, data: bytes) -> None:
        if not self._in_request and self._deadline is None and self.transport is not None:
            self._arm()  # the first byte of a later request's head
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.address is None:
            return  # refused at connection_made: aiohttp never saw it
        self.limits.release(self)
        self.gates.pop(self.transport, None)
        self.address = None
        self.inner.connection_lost(exc)


def gated(limits: ConnLimits, factory: Callable[[], asyncio.Protocol], gates: dict[object, Gate]
          ) -> Callable[[], asyncio.Protocol]:  # fmt: skip
    return lambda: Gate(limits, factory(), gates)
