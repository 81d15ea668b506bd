"""Connections to the API before any key is checked: bounded per client address and in all, and each must send a
request's headers within a deadline (slowloris). The API key is checked once the headers are in, so without this a
client that never finished a request could hold every file descriptor of the node: 1,100 half-sent requests once kept
a client with the key out for 80 s and grew the node by 208 MB.

``ConnLimits`` decides (pure: counts, no I/O, no clock); ``Gate`` is the thin asyncio shell between the listening
socket and aiohttp's own protocol, which it passes every byte to unchanged.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from dataclasses import dataclass, field

PER_ADDRESS = 64  # connections one client address may hold open at once
TOTAL = 768  # connections in all (kept under the file limit: see raise_file_limit)
HEADERS_S = 10.0  # from connecting, or from the first byte of a later request, to that request's whole head


@dataclass
class ConnLimits:
    per_address: int = PER_ADDRESS
    total: int = TOTAL
    open: dict[str, int] = field(default_factory=dict)

    def admit(self, address: str) -> bool:
        """Whether a new connection from ``address`` may be served; counted when it may."""
        if self.open.get(address, 0) >= self.per_address or sum(self.open.values()) >= self.total:
            return False
        self.open[address] = self.open.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        n = self.open.get(address, 0) - 1
        if n > 0:
            self.open[address] = n
        else:
            self.open.pop(address, None)


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
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else ""
        if not self.limits.admit(address):
            transport.abort()
            return
        self.address, self.transport = address, transport
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
        self.limits.release(self.address)
        self.gates.pop(self.transport, None)
        self.address = None
        self.inner.connection_lost(exc)


def gated(limits: ConnLimits, factory: Callable[[], asyncio.Protocol], gates: dict[object, Gate]
          ) -> Callable[[], asyncio.Protocol]:  # fmt: skip
    return lambda: Gate(limits, factory(), gates)
