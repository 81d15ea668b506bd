"""TCP <-> QUIC stream bridges (RPC and HTTP tunnels), with our own flow control.

QUIC grants its receive window as data arrives, not as it is consumed, and its sends never block: left alone, a
slow reader lets memory grow without bound. So tunnel streams carry frames, ``| u8 type | u32 len | data |``, and
the receiver grants credit back as its TCP socket takes the data. A sender never has more than WINDOW bytes
unacknowledged; per-token traffic (a few KB) never waits on credit.

A bridge is callbacks only: TCP bytes go out on the QUIC stream in the TCP socket's read callback, and the stream's
frames go to the TCP socket in the callback that delivers them. No task and no queue stand between: on the hot path
of a split every message used to wake three tasks on each side of the link (~0.1 ms a message on this machine).

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
from collections.abc import Callable
from dataclasses import dataclass

from meshllm.errors import RemoteProtocolError
from meshllm.net.conn import Stream
from meshllm.net.localuser import other_user

log = logging.getLogger("meshllm.tunnel")

DATA = 0
CREDIT = 1
HDR = struct.Struct(">BI")
CREDIT_FRAME = struct.Struct(">BII")  # a whole CREDIT frame: type, length 4, the byte count
WINDOW = 4 << 20
CREDIT_EVERY = 256 << 10
MAX_FRAME = 1 << 20
LINGER_S = 30.0  # once one direction has ended, how long the other may still run


@dataclass
class TunnelStats:
    bytes_up: int = 0  # TCP -> QUIC (to the peer)
    bytes_down: int = 0  # QUIC -> TCP (from the peer)
    tunnels: int = 0
    # what goes up (TCP -> QUIC) is shown to a watcher this makes, a new one per connection (the host's RPC tunnels
    # count llama-server's commands to each worker: the parser lives above, this layer carries bytes only)
    watcher: Callable[[], Callable[[bytes], None]] | None = None


class _Decoder:
    """Frames out of the stream's chunks, as they arrive: a DATA frame's payload is handed on in pieces (slices of
    the chunk it came in, no copy, never held back until the frame is whole: at 100+ MB/s reassembling 1 MB frames
    was a fifth of the receiver's time). Only a header or a CREDIT frame split across chunks is buffered."""

    def __init__(self) -> None:
        self.head = b""  # a header's first bytes
        self.typ = -1  # the frame being read, -1 between frames
        self.left = 0  # its payload bytes still to come
        self.credit = b""  # a CREDIT frame's payload so far

    def feed(self, data: bytes) -> list[tuple[int, bytes | memoryview]]:
        out: list[tuple[int, bytes | memoryview]] = []
        view = memoryview(data)
        i, n = 0, len(data)
        while i < n:
            if self.typ < 0:
                need = HDR.size - len(self.head)
                self.head += data[i : i + need]
                i += need
                if len(self.head) < HDR.size:
                    break
                typ, size = HDR.unpack(self.head)
                self.head = b""
                if typ not in (DATA, CREDIT) or size > MAX_FRAME or (typ == CREDIT and size != 4):
                    raise RemoteProtocolError("bad tunnel frame")
                self.typ, self.left = typ, size
            take = min(self.left, n - i)
            if self.typ == DATA:
                if take:
                    out.append((DATA, view[i : i + take]))
            else:
                self.credit += data[i : i + take]
            i += take
            self.left -= take
            if self.left == 0:
                if self.typ == CREDIT:
                    out.append((CREDIT, self.credit))
                    self.credit = b""
                self.typ = -1
        return out


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Bridge(asyncio.Protocol):
    """One tunnel: a TCP connection on loopback and a QUIC stream, pumped both ways in callbacks until both
    directions have ended (or one has, and LINGER_S passed); then both sides are closed and ``done`` is set."""

    def __init__(self, stream: Stream, stats: TunnelStats) -> None:
        self.stream = stream
        self.stats = stats
        self.watch = stats.watcher() if stats.watcher is not None else None
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # TCP -> QUIC
        self.window = WINDOW  # bytes we may still send before the peer grants more
        self.held = bytearray()  # TCP bytes beyond the window: sent as credit comes; TCP reads pause meanwhile
        self.eof_pending = False  # the TCP side ended while bytes were held: FIN after them
        self.up_done = False
        # QUIC -> TCP
        self.dec = _Decoder()
        self.uncredited = 0  # bytes from the peer not granted back yet; over WINDOW is a broken peer
        self.taken = 0  # of those, bytes our TCP socket took while it was not backed up
        self.backed_up = False  # the TCP socket's buffer is over its high-water mark: grant nothing
        self.down_done = False
        self._linger: asyncio.TimerHandle | None = None

    # -- TCP side (asyncio.Protocol)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        _nodelay(transport)
        self.stats.tunnels += 1
        self.stream.set_receiver(self._from_peer)

    def data_received(self, data: bytes) -> None:
        if self.held:
            self.held += data
        else:
            n = min(len(data), self.window)
            if n:
                self._send(data if n == len(data) else data[:n])
            if n < len(data):
                self.held += data[n:]
        if self.held and self.transport is not None:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.held:
            self.eof_pending = True
        else:
            self._end_up()
        return True  # keep the socket open: the other direction may still be running

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.debug("tunnel %d: %s", self.stream.id, exc)
        self.down_done = True  # nothing more can be written to the socket
        self._end_up()
        self.close()

    def pause_writing(self) -> None:
        self.backed_up = True

    def resume_writing(self) -> None:
        self.backed_up = False
        self.taken = self.uncredited
        self._grant(0)

    # -- QUIC side (Stream receiver)

    def _from_peer(self, data: bytes, end: bool) -> None:
        if self.done.done() or self.transport is None or self.transport.is_closing():
            return
        try:
            frames = self.dec.feed(data) if data else []
        except RemoteProtocolError as e:
            log.debug("tunnel %d: %s", self.stream.id, e)
            self.stream.reset()
            self.close()
            return
        for typ, payload in frames:
            if typ == CREDIT:
                (n,) = struct.unpack(">I", payload)
                self.window += n
                self._flush_held()
                continue
            self.uncredited += len(payload)
            if self.uncredited > WINDOW:  # a peer that keeps to its credit never has more than WINDOW unacknowledged
                log.debug("tunnel %d: the peer ignored flow control", self.stream.id)
                self.stream.reset()
                self.close()
                return
            self.transport.write(payload)
            self.stats.bytes_down += len(payload)
            if not self.backed_up:
                self._grant(len(payload))
        if end and not self.down_done:
            self.down_done = True
            with contextlib.suppress(Exception):
                if self.transport.can_write_eof():
                    self.transport.write_eof()
            self._maybe_finish()

    # -- the pieces

    def _send(self, data: bytes | bytearray) -> None:
        """Frames to the peer (the caller checked the window)."""
        self.window -= len(data)
        self.stats.bytes_up += len(data)
        if self.watch is not None:
            self.watch(bytes(data))
        try:
            for i in range(0, len(data), MAX_FRAME):
                part = data[i : i + MAX_FRAME]
                self.stream.write(HDR.pack(DATA, len(part)) + part)
        except ConnectionError:
            self.close()

    def _flush_held(self) -> None:
        if self.held and self.window > 0:
            n = min(len(self.held), self.window)
            chunk, self.held = self.held[:n], self.held[n:]
            self._send(chunk)
        if not self.held:
            if self.eof_pending:
                self.eof_pending = False
                self._end_up()
            elif self.transport is not None and not self.up_done:
                self.transport.resume_reading()

    def _grant(self, n: int) -> None:
        """Our TCP socket took ``n`` more bytes: give the peer credit back in CREDIT_EVERY steps."""
        self.taken += n
        if self.taken >= CREDIT_EVERY:
            with contextlib.suppress(ConnectionError):
                self.stream.write(CREDIT_FRAME.pack(CREDIT, 4, self.taken))
            self.uncredited -= self.taken
            self.taken = 0

    def _end_up(self) -> None:
        if not self.up_done:
            self.up_done = True
            self.stream.close()  # FIN: the peer's TCP sees EOF
            self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.up_done and self.down_done:
            self.close()
        elif self._linger is None and not self.done.done():
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def close(self) -> None:
        """Both sides closed, now: the TCP socket, and the stream with a FIN (never a reset here, which would drop
        data still queued for the peer)."""
        if self._linger is not None:
            self._linger.cancel()
        if self.transport is not None:
            self.transport.close()
        self.stream.close()  # no-op when already finished
        if not self.done.done():
            self.done.set_result(None)


async def _run(bridge: Bridge) -> None:
    """Wait for a bridge to finish; cancelling the wait closes it (a host change drops stale tunnels that way)."""
    try:
        await asyncio.shield(bridge.done)
    finally:
        bridge.close()


class TunnelListener:
    """A loopback TCP listener; each accepted connection is carried over a new stream from ``open_stream``."""

    def __init__(self, open_stream: Callable[[], Stream | None], stats: TunnelStats) -> None:
        self.open_stream = open_stream
        self.stats = stats
        self.server: asyncio.Server | None = None
        self.port = 0
        self._bridges: set[Bridge] = set()

    async def start(self) -> int:
        self.server = await asyncio.get_running_loop().create_server(self._protocol, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def _protocol(self) -> asyncio.Protocol:
        return _Gate(self)

    def bridge(self, transport: asyncio.Transport) -> None:
        """An accepted client of our own user: carried over a new stream (closed at once if the peer is gone)."""
        st = self.open_stream()
        if st is None:
            transport.close()
            return
        b = Bridge(st, self.stats)
        self._bridges.add(b)
        b.done.add_done_callback(lambda _: self._bridges.discard(b))
        transport.set_protocol(b)
        b.connection_made(transport)

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for b in list(self._bridges):
            b.close()


class _Gate(asyncio.Protocol):
    """A new client of a tunnel listener: only processes of our own user get through (our llama-server). Others on
    the machine could otherwise speak RPC to the workers at the far end, and whoever reaches an rpc-server owns it."""

    def __init__(self, listener: TunnelListener) -> None:
        self.listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        uid = other_user(transport)
        if uid is not None:
            log.warning("refused a tunnel client of another user of this machine (uid %d)", uid)
            transport.close()
            return
        self.listener.bridge(transport)


async def connect_and_bridge(
    stream: Stream, port: int, stats: TunnelStats, names: dict[int, str] | None = None, name: str = ""
) -> None:
    """The far end of a tunnel: connect to a loopback service and bridge the stream to it until both ends are done.
    ``names``: while it lasts, our end's port -> ``name`` (so the service can tell whose connection it serves)."""
    loop = asyncio.get_running_loop()
    try:
        transport, bridge = await loop.create_connection(lambda: Bridge(stream, stats), "127.0.0.1", port)
    except OSError as e:
        log.warning("tunnel to 127.0.0.1:%d failed: %s", port, e)
        stream.reset()
        return
    ours = int(transport.get_extra_info("sockname")[1])
    if names is not None:
        names[ours] = name
    try:
        await _run(bridge)
    finally:
        if names is not None:
            names.pop(ours, None)
