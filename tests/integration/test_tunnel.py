"""Tunnels (net/tunnel.py) over real QUIC on loopback: bytes arrive intact both ways, a slow reader holds the
sender to the window, a bad frame or a dead service closes the TCP side instead of hanging it."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from meshllm.net import tunnel
from meshllm.net.conn import STREAM_RPC, Conn, Stream
from meshllm.net.endpoint import Endpoint
from meshllm.net.tunnel import TunnelListener, TunnelStats, connect_and_bridge
from meshllm.proto import crypto

pytestmark = pytest.mark.timeout(120)  # a stalled tunnel is a failure, not a hung suite


@dataclass
class Pair:
    conn: Conn  # the dialler's side
    near: TunnelStats  # the listener side (TCP clients -> tunnel)
    far: TunnelStats  # the far side (tunnel -> service)
    port: int  # where TCP clients connect


@asynccontextmanager
async def tunnel_to(
    service_port: int, on_stream: Callable[[Stream], Awaitable[None]] | None = None
) -> AsyncIterator[Pair]:
    """Endpoint A listens on loopback TCP; each client is carried to endpoint B, which connects it to
    ``service_port`` (or hands the raw stream to ``on_stream``)."""
    far = TunnelStats()
    jobs: set[asyncio.Future[None]] = set()

    async def on_accept(conn: Conn) -> None:
        conn.set_authenticated()  # the auth protocol is not under test here
        while (st := await conn.accept()) is not None:
            job = on_stream(st) if on_stream else connect_and_bridge(st, service_port, far)
            jobs.add(asyncio.ensure_future(job))

    a, b = Endpoint(crypto.new_key()), Endpoint(crypto.new_key(), on_accept=on_accept)
    await a.open("127.0.0.1", 0)
    addr = await b.open("127.0.0.1", 0)
    near = TunnelStats()
    try:
        conn = await a.dial(addr, b.me)
        conn.set_authenticated()
        listener = TunnelListener(lambda: conn.open_stream(STREAM_RPC), near)
        port = await listener.start()
        yield Pair(conn, near, far, port)
        await listener.close()
    finally:
        a.close()
        b.close()


async def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _read_all(reader: asyncio.StreamReader, n: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), 60)


def test_bytes_cross_intact_both_ways_and_eof_is_passed_on() -> None:
    """A full-duplex client (it reads while it writes) and a service that writes everything before it reads: fine
    over plain TCP; the tunnel once stalled it (a blocked write to the service also held up the credit frames of
    the other direction)."""
    up, down = os.urandom(24_000_000), os.urandom(24_000_000)

    async def main() -> None:
        got_up: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def service(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(down)
            await w.drain()
            got_up.set_result(await r.read())  # until EOF: the client's half-close must reach us
            w.close()

        srv = await asyncio.start_server(service, "127.0.0.1", 0)
        async with tunnel_to(srv.sockets[0].getsockname()[1]) as p:
            r, w = await asyncio.open_connection("127.0.0.1", p.port)

            async def send() -> None:
                w.write(up)
                await w.drain()
                w.write_eof()

            sending = asyncio.ensure_future(send())
            assert hashlib.sha256(await _read_all(r, len(down))).digest() == hashlib.sha256(down).digest()
            await asyncio.wait_for(sending, 60)
            assert await asyncio.wait_for(got_up, 30) == up
            assert await asyncio.wait_for(r.read(), 10) == b"", "the service's close did not reach the client"
            w.close()
            assert p.near.bytes_up == len(up) and p.near.bytes_down == len(down) and p.near.tunnels == 1
        srv.close()

    asyncio.run(main())


def test_a_slow_reader_holds_the_sender_to_the_window() -> None:
    data = os.urandom(64 << 20)

    async def main() -> None:
        release = asyncio.Event()
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def slow_service(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await release.wait()  # reads nothing until told
            got.set_result(await r.readexactly(len(data)))
            w.close()

        srv = await asyncio.start_server(slow_service, "127.0.0.1", 0)
        async with tunnel_to(srv.sockets[0].getsockname()[1]) as p:
            _r, w = await asyncio.open_connection("127.0.0.1", p.port)
            w.write(data)
            # wait until the sender stalls: its count stops moving for half a second
            last, still = -1, 0
            while still < 25:
                await asyncio.sleep(0.02)
                still = still + 1 if p.near.bytes_up == last else 0
                last = p.near.bytes_up
            in_flight = p.near.bytes_up - p.far.bytes_down
            assert p.near.bytes_up < len(data), "nothing held the sender back"
            assert in_flight <= tunnel.WINDOW, f"{in_flight} bytes in flight, window {tunnel.WINDOW}"
            release.set()
            assert hashlib.sha256(await asyncio.wait_for(got, 60)).digest() == hashlib.sha256(data).digest()
            w.close()
        srv.close()

    asyncio.run(main())


def test_a_bad_frame_closes_the_tcp_side() -> None:
    async def main() -> None:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)

        async def garbage(st: Stream) -> None:
            st.write(bytes([7]) + (5).to_bytes(4, "big") + b"hello")  # frame type 7 does not exist

        async with tunnel_to(srv.sockets[0].getsockname()[1], on_stream=garbage) as p:
            r, _w = await asyncio.open_connection("127.0.0.1", p.port)
            _w.write(b"x")
            assert await asyncio.wait_for(r.read(), 10) == b""
        srv.close()

    asyncio.run(main())


def test_an_oversized_frame_is_refused_before_it_is_buffered() -> None:
    dec = tunnel._Decoder()
    try:
        dec.feed(tunnel.HDR.pack(tunnel.DATA, tunnel.MAX_FRAME + 1))
    except Exception as e:
        assert "bad tunnel frame" in str(e)
    else:
        raise AssertionError("a frame over MAX_FRAME was accepted")
    assert tunnel._Decoder().feed(tunnel.HDR.pack(tunnel.DATA, 3) + b"abc") == [(tunnel.DATA, b"abc")]


def test_a_service_that_is_not_there_resets_the_stream_and_closes_the_client() -> None:
    async def main() -> None:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        dead = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        async with tunnel_to(dead) as p:
            r, w = await asyncio.open_connection("127.0.0.1", p.port)
            w.write(b"hello")
            assert await asyncio.wait_for(r.read(), 10) == b"", "the client waits (the bridge's drain is 30 s)"
            assert p.far.tunnels == 0

    asyncio.run(main())


def test_cancelling_the_far_end_closes_both_sides() -> None:
    """A host change drops stale RPC tunnels by cancelling their task (serve/split/hosting.py): the service's socket and
    the tunnel's client must both see the end, not hang."""

    async def main() -> None:
        service_eof = asyncio.Event()

        async def service(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(await r.readexactly(5))
            await r.read()  # until the tunnel closes us
            service_eof.set()
            w.close()

        srv = await asyncio.start_server(service, "127.0.0.1", 0)
        jobs: list[asyncio.Task[None]] = []

        async def far(st: Stream) -> None:
            jobs.append(asyncio.current_task())  # type: ignore[arg-type]
            await connect_and_bridge(st, srv.sockets[0].getsockname()[1], TunnelStats())

        async with tunnel_to(0, on_stream=far) as p:
            r, w = await asyncio.open_connection("127.0.0.1", p.port)
            w.write(b"hello")
            assert await _read_all(r, 5) == b"hello"
            jobs[0].cancel()
            await asyncio.wait_for(service_eof.wait(), 10)
            assert await asyncio.wait_for(r.read(), 10) == b""
            w.close()
        srv.close()

    asyncio.run(main())
