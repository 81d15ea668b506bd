"""The benchmark delay element: datagrams leave rtt/2 later, in order, no faster than the rate."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from meshllm.errors import UserError
from meshllm.net.netem import LinkShape, Shaper


def test_parse() -> None:
    assert LinkShape.parse("rtt=5,rate=30") == LinkShape(5.0, 30.0)
    assert LinkShape.parse("rtt=20") == LinkShape(20.0, 0.0)
    with pytest.raises(UserError):
        LinkShape.parse("delay=5")
    with pytest.raises(UserError):
        LinkShape.parse("rtt=fast")


def test_delay_order_and_rate() -> None:
    async def run() -> list[tuple[float, bytes]]:
        loop = asyncio.get_running_loop()
        got: list[tuple[float, bytes]] = []
        sh = Shaper(LinkShape(rtt_ms=40, rate_mb_s=1.0), lambda d, a: got.append((loop.time(), d)))
        t0 = loop.time()
        for i in range(5):
            sh.send(bytes([i]) * 10_000, ("127.0.0.1", 1))  # 10 ms each at 1 MB/s
        await asyncio.sleep(0.2)
        return [(t - t0, d) for t, d in got]

    got = asyncio.run(run())
    assert [d[0] for _, d in got] == [0, 1, 2, 3, 4]
    # the first leaves after its 10 ms on the wire + 20 ms; each next one 10 ms later
    assert got[0][0] >= 0.029 and got[-1][0] >= 0.069
    assert all(b[0] - a[0] >= 0.009 for a, b in itertools.pairwise(got))


def test_a_full_queue_drops() -> None:
    async def run() -> int:
        sh = Shaper(LinkShape(rtt_ms=0, rate_mb_s=1.0), lambda d, a: None)
        for _ in range(20):
            sh.send(b"x" * 10_000, ("127.0.0.1", 1))  # 200 ms of data into a 50 ms queue
        return sh.dropped

    assert asyncio.run(run()) >= 10
