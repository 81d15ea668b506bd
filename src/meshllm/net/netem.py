"""Latency and bandwidth injection for benchmarks (the kernel here has no netem): a datagram delay element on the
node's own UDP socket.

``MESH_LLM_NETEM="rtt=5,rate=30"`` makes every datagram this node sends wait rtt/2 ms, and each destination's
datagrams leave no faster than ``rate`` MB/s (a 50 ms queue, then tail drop, as a router would). With it on
every node, each link's round trip grows by ``rtt`` ms and each direction is capped at ``rate``. Off unless set;
it never changes what is sent, only when. A worker's RPC listeners (the direct path, peer links) get the same
round trip from TCP relays in front of them (``meshllm.delaytcp``, ``llama/supervisor.RpcServer``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

from meshllm.errors import UserError

Addr = tuple[str, int]
QUEUE_S = 0.05


@dataclass(frozen=True)
class LinkShape:
    rtt_ms: float = 0.0  # added to each link's round trip (half on each side's sends)
    rate_mb_s: float = 0.0  # per destination, MB/s (10^6 bytes); 0: unlimited

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        fields: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            k, _, v = part.partition("=")
            if k not in ("rtt", "rate"):
                raise UserError(f"MESH_LLM_NETEM: unknown field {k!r} (use rtt=MS,rate=MB_PER_S)")
            try:
                fields[k] = float(v)
            except ValueError:
                raise UserError(f"MESH_LLM_NETEM: {k}={v!r} is not a number") from None
        return cls(fields.get("rtt", 0.0), fields.get("rate", 0.0))

    @classmethod
    def from_env(cls) -> LinkShape | None:
        text = os.environ.get("MESH_LLM_NETEM", "").strip()
        return cls.parse(text) if text else None


class Shaper:
    """Sends each datagram through ``send`` after its delay, in order per destination."""

    def __init__(self, shape: LinkShape, send: Callable[[bytes, Addr], None]) -> None:
        self.delay = shape.rtt_ms / 2000.0
        self.rate = shape.rate_mb_s * 1e6
        self._send = send
        self._free_at: dict[Addr, float] = {}  # when the destination's "wire" is free again
        self._heap: list[tuple[float, int, bytes, Addr]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self.dropped = 0

    def send(self, data: bytes, addr: Addr) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        depart = now
        if self.rate > 0:
            start = max(now, self._free_at.get(addr, now))
            if start - now > QUEUE_S:
                self.dropped += 1
                return
            depart = start + len(data) / self.rate
            self._free_at[addr] = depart
        heapq.heappush(self._heap, (depart + self.delay, next(self._seq), data, addr))
        if self._timer is None:
            self._timer = loop.call_at(self._heap[0][0], self._flush)

    def _flush(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._heap and self._heap[0][0] <= now:
            _, _, data, addr = heapq.heappop(self._heap)
            self._send(data, addr)
        if self._heap:
            self._timer = loop.call_at(self._heap[0][0], self._flush)
