"""TCP <-> QUIC stream bridges (RPC and HTTP tunnels), with our own flow control.

aioquic opens its receive window as data arrives, not as it is consumed, and its sends never block: left alone,
a slow reader lets memory grow without bound. So tunnel streams carry frames, ``| u8 type | u32 len | data |``,
and the receiver grants credit back as it writes data out to its TCP socket. A sender never has more than
WINDOW bytes unacknowledged; per-token traffic (a few KB) never waits on credit.

Every TCP socket has TCP_NODELAY: Nagle plus delayed ACKs on small RPC writes cost 7x (DESIGN.md). A close on
either side is passed on at once: TCP EOF becomes a QUIC FIN and the other way round; a reset or a lost
connection closes the TCP socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from meshllm.errors import RemoteProtocolError
from meshllm.llama.rpcwire import CommandParser, WireStats
from meshllm.net.endpoint import Stream

log = logging.getLogger("meshllm.tunnel")

DATA = 0
CREDIT = 1
HDR = struct.Struct(">BI")
WINDOW = 4 << 20
CREDIT_EVERY = 256 << 10
READ_CHUNK = 256 << 10
MAX_FRAME = 1 << 20


@dataclass
class TunnelStats:
    bytes_up: int = 0  # TCP -> QUIC (to the peer)
    bytes_down: int = 0  # QUIC -> TCP (from the peer)
    tunnels: int = 0
    rpc: WireStats | None = None  # host side of RPC tunnels: what llama-server asked of the worker


class _Decoder:
    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= HDR.size:
            typ, n = HDR.unpack_from(self.buf)
            if typ not in (DATA, CREDIT) or n > MAX_FRAME:
                raise RemoteProtocolError("bad tunnel frame")
            if len(self.buf) < HDR.size + n:
                break
            out.append((typ, bytes(self.buf[HDR.size : HDR.size + n])))
            del self.buf[: HDR.size + n]
        return out


def nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def bridge(stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 stats: TunnelStats | None = None) -> None:  # fmt: skip
    """Pump both ways until both directions have ended; then close both sides."""
    nodelay(writer)
    stats = stats or TunnelStats()
    stats.tunnels += 1
    parser = CommandParser(stats.rpc) if stats.rpc is not None else None
    window = WINDOW
    credit_changed = asyncio.Event()

    async def tcp_to_quic() -> None:
        nonlocal window
        try:
            while True:
                data = await reader.read(READ_CHUNK)
                if not data:
                    break
                while window < len(data):
                    credit_changed.clear()
                    await credit_changed.wait()
                window -= len(data)
                stats.bytes_up += len(data)
                if parser is not None:
                    parser.feed(data)
                stream.write(HDR.pack(DATA, len(data)) + data)
        except (ConnectionError, OSError):
            pass
        finally:
            stream.close()  # FIN: the peer's TCP sees EOF

    # QUIC -> TCP is two tasks: one reads frames (credit for our own sends is applied at once), one writes data
    # to the socket and grants credit as it goes. In one task, a local reader that stops reading would stall the
    # credit for the other direction too: a service that writes before it reads deadlocked a full-duplex client.
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    queued = 0  # bytes in inbox: the peer may have at most WINDOW unacknowledged

    async def read_frames() -> None:
        nonlocal window, queued
        dec = _Decoder()
        try:
            while True:
                chunk = await stream.read()
                if not chunk:
                    break
                for typ, payload in dec.feed(chunk):
                    if typ == CREDIT:
                        (n,) = struct.unpack(">I", payload)
                        window += n
                        credit_changed.set()
                        continue
                    queued += len(payload)
                    if queued > WINDOW + MAX_FRAME:
                        raise RemoteProtocolError("tunnel peer ignored flow control")
                    inbox.put_nowait(payload)
        except (ConnectionError, OSError, RemoteProtocolError) as e:
            log.debug("tunnel %d: %s", stream.id, e)
        finally:
            inbox.put_nowait(None)
            credit_changed.set()

    async def quic_to_tcp() -> None:
        nonlocal queued
        consumed = 0
        try:
            while (payload := await inbox.get()) is not None:
                writer.write(payload)
                await writer.drain()
                queued -= len(payload)
                stats.bytes_down += len(payload)
                consumed += len(payload)
                if consumed >= CREDIT_EVERY:
                    stream.write(HDR.pack(CREDIT, 4) + struct.pack(">I", consumed))
                    consumed = 0
        except (ConnectionError, OSError) as e:
            log.debug("tunnel %d: %s", stream.id, e)
        finally:
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    writer.write_eof()
            credit_changed.set()

    up = asyncio.ensure_future(tcp_to_quic())
    frames = asyncio.ensure_future(read_frames())
    down = asyncio.ensure_future(quic_to_tcp())
    try:
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        # one direction ended: give the other a moment to drain, then close everything
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(up, down, return_exceptions=True), timeout=30)
    finally:
        for t in (up, frames, down):
            t.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        stream.close()  # no-op when already finished; never a reset, which would drop data still queued


class TunnelListener:
    """A loopback TCP listener; each accepted connection is carried over a new stream from ``open_stream``."""

    def __init__(self, open_stream: Callable[[], Stream | None], stats: TunnelStats) -> None:
        self.open_stream = open_stream
        self.stats = stats
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        st = self.open_stream()
        if st is None:
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await bridge(st, reader, writer, self.stats)
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for t in list(self._tasks):
            t.cancel()


async def connect_and_bridge(stream: Stream, port: int, stats: TunnelStats,
                             on_open: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
    """The far end of a tunnel: connect to a loopback service and bridge the stream to it."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        log.warning("tunnel to 127.0.0.1:%d failed: %s", port, e)
        stream.reset()
        return
    await bridge(stream, reader, writer, stats)
