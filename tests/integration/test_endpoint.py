"""The QUIC endpoint on loopback: key pinning, streams held until authentication, finished streams forgotten,
control packets routed apart."""

from __future__ import annotations

import asyncio

import pytest

from meshllm.net.endpoint import STREAM_AUTH, STREAM_GOSSIP, Conn, DialError, Endpoint
from meshllm.proto import crypto


async def _pair() -> tuple[Endpoint, Endpoint, asyncio.Queue[Conn], tuple[str, int]]:
    accepted: asyncio.Queue[Conn] = asyncio.Queue()

    async def on_accept(conn: Conn) -> None:
        await accepted.put(conn)

    a, b = Endpoint(crypto.new_key()), Endpoint(crypto.new_key(), on_accept=on_accept)
    await a.open("127.0.0.1", 0)
    addr = await b.open("127.0.0.1", 0)
    return a, b, accepted, addr


def test_dialler_pins_the_listeners_key() -> None:
    async def main() -> None:
        a, b, _, addr = await _pair()
        try:
            conn = await a.dial(addr, b.me)
            assert conn.peer == b.me
            with pytest.raises(DialError, match="not the node we dialled"):
                await a.dial(addr, crypto.node_id(crypto.new_key()))
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_streams_wait_for_authentication_and_finished_ones_are_forgotten() -> None:
    async def main() -> None:
        a, b, accepted, addr = await _pair()
        try:
            conn = await a.dial(addr, b.me)
            early = conn.open_stream(STREAM_GOSSIP)  # before auth: must not be handed out
            early.write(b"x")
            auth = conn.open_stream(STREAM_AUTH)
            auth.write(b"hello")
            server = await asyncio.wait_for(accepted.get(), 5)
            first = await asyncio.wait_for(server.accept(), 5)
            assert first is not None and first.kind == STREAM_AUTH
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(server.accept(), 0.3)
            server.set_authenticated()
            held = await asyncio.wait_for(server.accept(), 5)
            assert held is not None and held.kind == STREAM_GOSSIP
            # twenty request/response streams, each finished both ways: none left behind on either side
            for i in range(20):
                st = conn.open_stream(STREAM_GOSSIP)
                st.write(f"ping {i}".encode(), end=True)
                peer = await asyncio.wait_for(server.accept(), 5)
                assert peer is not None
                assert await peer.read() == f"ping {i}".encode()
                assert await peer.read() == b""
                peer.write(b"pong", end=True)
                assert await st.read() == b"pong" and await st.read() == b""
            await asyncio.sleep(0.1)
            assert len(conn.streams) <= 3 and len(server.streams) <= 3, (len(conn.streams), len(server.streams))
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_control_packets_are_not_quic() -> None:
    async def main() -> None:
        got: asyncio.Queue[bytes] = asyncio.Queue()
        a, b = Endpoint(crypto.new_key()), Endpoint(crypto.new_key(), on_control=lambda d, _a: got.put_nowait(d))
        await a.open("127.0.0.1", 0)
        addr = await b.open("127.0.0.1", 0)
        try:
            a.send_control(b"\x01probe", addr)
            assert await asyncio.wait_for(got.get(), 5) == b"\x01probe"
            with pytest.raises(ValueError):
                a.send_control(b"\x41looks like quic", addr)
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_a_bad_address_cannot_close_the_socket() -> None:
    """[trust] asyncio closes a UDP transport for good on a send error that is not an OSError; a peer that gossips
    127.0.0.1:70000 once took every node's only socket down. Now such sends are dropped and the socket lives."""

    async def main() -> None:
        a, b, _, addr = await _pair()
        try:
            for bad in [("127.0.0.1", 70000), ("127.0.0.1", -1), ("127.0.0.1\0", 7000), ("", 7000)]:
                a.send_control(b"\x01probe", bad)
                a.send_control(b"\x01probe", bad, ttl=2)
            await asyncio.sleep(0.1)
            assert a.transport is not None and not a.transport.is_closing()
            conn = await a.dial(addr, b.me)  # and the socket still works
            assert conn.peer == b.me
        finally:
            a.close()
            b.close()

    asyncio.run(main())
