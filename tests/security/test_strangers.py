"""What a stranger on the network can do to a node before it authenticates, on loopback with the real QUIC
endpoint: junk datagrams, a flood of real Initials (bounded pending handshakes and RSS, a member's connection keeps
answering), streams and bytes parked before authentication, and an address that once closed a node's only socket."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import psutil
import pytest
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection

from meshllm.net import endpoint
from meshllm.net.conn import (
    ALPN,
    MAX_BYTES_BEFORE_AUTH,
    MAX_HELD_STREAMS,
    STREAM_GOSSIP,
)
from meshllm.proto import reach
from tests.integration.test_endpoint import _pair, _until


def test_a_bad_address_cannot_close_the_socket() -> None:
    """Asyncio closes a UDP transport for good on a send error that is not an OSError; a peer that gossips
    127.0.0.1:70000 once took every node's only socket down. Now such sends are dropped and the socket lives."""

    async def main() -> None:
        a, b, _, addr = await _pair()
        try:
            for bad in [("127.0.0.1", 70000), ("127.0.0.1", -1), ("127.0.0.1\0", 7000), ("", 7000)]:
                a.send_control(b"\x01probe", bad)
                a.send_control(b"\x01probe", bad, ttl=2)
            await asyncio.sleep(0)  # anything the sends scheduled runs
            assert a.transport is not None and not a.transport.is_closing()
            conn = await a.dial(addr, b.me)  # and the socket still works
            assert conn.peer == b.me
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_too_many_streams_before_authentication_close_the_connection() -> None:
    async def main() -> None:
        a, b, accepted, addr = await _pair()
        try:
            conn = await a.dial(addr, b.me)
            for _ in range(MAX_HELD_STREAMS + 1):
                conn.open_stream(STREAM_GOSSIP).write(b"x")
            server = await asyncio.wait_for(accepted.get(), 5)
            await asyncio.wait_for(server.closed.wait(), 5)
            assert server.close_reason == "too many streams before authentication"
            await asyncio.wait_for(conn.closed.wait(), 5)  # the dialler hears of it
            assert await asyncio.wait_for(server.accept(), 1) is None
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_junk_datagrams_make_no_connection_and_leave_the_socket_working() -> None:
    async def main() -> None:
        a, b, _, addr = await _pair()
        junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            cfg = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
            quic = QuicConnection(configuration=cfg)
            quic.connect(addr, now=0.0)
            initial = quic.datagrams_to_send(now=0.0)[0][0]
            for d in [
                b"\x40",  # a short header with no room for a connection id
                b"\x40" + os.urandom(40),  # a 1-RTT packet for a connection id nobody issued
                b"\xc0" + os.urandom(30),  # a long header that does not parse
                initial[:600],  # an Initial below the 1200-byte minimum (anti-amplification)
                bytes([reach.RELAYED]) + os.urandom(40),  # "relayed" by a node we hold no connection with
            ]:
                junk.sendto(d, addr)
            junk.sendto(b"\x41", addr)  # a sentinel: once it is counted, everything before it was handled
            await _until(lambda: b.stats.datagrams_in >= 6)
            assert not b.conns, "junk made a connection"
            assert b.transport is not None and not b.transport.is_closing()
            assert (await a.dial(addr, b.me)).peer == b.me
        finally:
            junk.close()
            a.close()
            b.close()

    asyncio.run(main())


def test_a_peer_that_never_authenticates_cannot_park_megabytes() -> None:
    """QUIC (aioquic, qh3) grants credit as data arrives: a key that never authenticated once queued 98 MB."""

    async def main() -> None:
        a, b, accepted, addr = await _pair()
        try:
            conn = await a.dial(addr, b.me)
            st = conn.open_stream(STREAM_GOSSIP)
            for _ in range(16):
                st.write(os.urandom(64 << 10))
            server = await asyncio.wait_for(accepted.get(), 5)
            await asyncio.wait_for(server.closed.wait(), 10)
            assert server.close_reason == "too much data before authentication"
            assert sum(s.bytes_in for s in server.streams.values()) <= MAX_BYTES_BEFORE_AUTH
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_a_flood_of_initials_holds_at_most_max_pending_handshakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Initial with a new connection id used to hold a connection for 10 s: a flood grew RSS by
    hundreds of MB. Now at most MAX_PENDING wait; the rest are dropped, a member's connection keeps answering all
    through the flood, and new peers get in again after."""
    monkeypatch.setattr(endpoint, "ACCEPT_TIMEOUT_S", 1.0)
    flood = 1500

    async def main() -> None:
        a, b, accepted, addr = await _pair()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # a member connected before the flood, with an echo stream
            member = await a.dial(addr, b.me)
            member.set_authenticated()
            server = await asyncio.wait_for(accepted.get(), 5)
            server.set_authenticated()
            ping = member.open_stream(STREAM_GOSSIP)
            ping.write(b"?")
            echo = await asyncio.wait_for(server.accept(), 5)
            assert echo is not None and await echo.read() == b"?"
            echo.set_receiver(lambda data, end: echo.write(data) if data and not end else None)
            answered: list[float] = []

            async def one_ping() -> None:
                t = asyncio.get_running_loop().time()
                ping.write(b"!")
                assert await asyncio.wait_for(ping.read(), 2) == b"!", "the member's connection stopped answering"
                answered.append(asyncio.get_running_loop().time() - t)

            cfg = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
            initials = []
            for _ in range(flood):
                quic = QuicConnection(configuration=cfg)  # a real Initial, a new connection id each time
                quic.connect(addr, now=0.0)
                initials.append(quic.datagrams_to_send(now=0.0)[0][0])
            rss0 = psutil.Process().memory_info().rss
            most = 0
            for i, d in enumerate(initials):
                sock.sendto(d, addr)
                if i % 50 == 49:
                    await asyncio.sleep(0.005)  # let b read
                    most = max(most, sum(1 for c in b.conns if not c.is_client and not c.authenticated))
                    await one_ping()
            await _until(lambda: b.stats.datagrams_in >= flood * 0.9)
            most = max(most, sum(1 for c in b.conns if not c.is_client and not c.authenticated))
            grew = (psutil.Process().memory_info().rss - rss0) / 1e6
            print(f"\n{b.stats.datagrams_in} Initials: {b.stats.initials_dropped} dropped, at most {most} pending, "
                  f"RSS +{grew:.1f} MB; a member's {len(answered)} pings meanwhile: slowest "
                  f"{max(answered) * 1000:.1f} ms")  # fmt: skip
            assert most <= endpoint.MAX_PENDING and b.stats.initials_dropped > flood // 2
            assert grew < 64, f"RSS grew {grew:.0f} MB under the flood"
            await _until(
                lambda: not [c for c in b.conns if not c.is_client and not c.authenticated], timeout=15
            )  # the handshakes time out
            conn = await a.dial(addr, b.me)  # and a real peer gets in
            assert conn.peer == b.me
        finally:
            sock.close()
            a.close()
            b.close()

    asyncio.run(main())
