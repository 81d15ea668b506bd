"""One UDP socket per node carrying QUIC connections in both roles, and room for non-QUIC control packets.

QUIC is qh3's sans-IO ``QuicConnection`` (an aioquic fork whose connection core is native code: 4x aioquic's
throughput through a tunnel here, half its round-trip time; README, "On GPUs"). Its own ``connect()``/``serve()``
each make a socket; here we drive ``QuicConnection`` ourselves and demultiplex by connection id. A datagram whose
first byte has bit 0x40 clear is not QUIC (every QUIC v1 packet sets that bit): hole-punch probes go to
``on_control``; RELAY packets are forwarded when this node relays (``relay_server``); RELAYED packets are unwrapped
and belong to the connection whose virtual address names the relay and the peer (see proto/reach.py; QUIC itself
sees a fixed stand-in address, ``VIRTUAL_PEER``), so a relayed connection is an ordinary QUIC connection,
end to end, whose datagrams happen to travel through a member.

Identity: each node's TLS certificate is self-signed with its Ed25519 node key. The dialler checks after the
handshake that the certificate's key is the NodeId it meant to reach (TLS already checked that the peer holds
that key: CertificateVerify), and closes otherwise. The listener learns the dialler's key from the auth stream.

Streams are typed: the opener's first byte says what the stream is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import hmac
import logging
import socket
import ssl
import struct
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID
from qh3._hazmat import Buffer
from qh3.quic import events
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection, QuicConnectionError
from qh3.quic.packet import QuicErrorCode, QuicPacketType, pull_quic_header

from meshllm import sockets
from meshllm.errors import MeshError
from meshllm.net.netem import LinkShape, Shaper
from meshllm.proto import crypto, reach
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId

log = logging.getLogger("meshllm.net")
# qh3 logs every close by a peer as a warning; a node's own lines say when a peer leaves and why (Conn.close_reason)
logging.getLogger("quic").setLevel(logging.ERROR)

ALPN = "mesh-llm/1"
CID_LEN = 8
IDLE_TIMEOUT_S = 20.0
KEEPALIVE_S = 7.0
MIN_INITIAL = 1200
ED25519 = 0x0807  # the TLS signature scheme of node keys: the only one a dialler offers
# what QUIC sees as a relayed connection's peer address (each QuicConnection has its own: one value serves all).
# qh3 wants an IP; the datagrams themselves go wherever Conn.addr says (a relay, or the punched shortcut)
VIRTUAL_PEER: tuple[str, int] = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): routes nowhere

STREAM_AUTH = 1
STREAM_GOSSIP = 2
STREAM_RPC = 3
STREAM_HTTP = 4
STREAM_RPC_KEY = 5  # the host asks a worker for the key of its rpc-server's direct (TLS) listener
STREAM_FETCH = 6  # a member asks for a model file's manifest or a chunk of it (serve/fetch/sharing.py)
STREAM_KNOCK = 7  # [lan] a node with no token asks to join (proto/knock.py): answered, never authenticated
STREAM_PEER_OPEN = 8  # the host asks a worker for a loopback port leading to the next worker (serve/split/peerlinks.py)
STREAM_PEER = 9  # a worker's hidden state to the next worker's rpc-server (worker to worker over the mesh)
STREAM_KINDS = {
    STREAM_AUTH: "auth", STREAM_GOSSIP: "gossip", STREAM_RPC: "rpc", STREAM_HTTP: "http", STREAM_RPC_KEY: "rpc-key",
    STREAM_FETCH: "fetch", STREAM_KNOCK: "knock", STREAM_PEER_OPEN: "peer-open", STREAM_PEER: "peer",
}  # fmt: skip
BEFORE_AUTH = (STREAM_AUTH, STREAM_KNOCK)  # the streams a listener hands out before a connection is authenticated
MAX_HELD_STREAMS = 8
MAX_BYTES_BEFORE_AUTH = 256 << 10  # an auth proof is a few hundred bytes: anything near this is not one
MAX_PENDING = 64  # incoming connections not yet authenticated; more Initials are dropped until some finish
ACCEPT_TIMEOUT_S = 10.0  # an incoming handshake that has not completed by then is dropped

Addr = tuple[str, int]


class DialError(MeshError):
    pass


def parse_addr(text: str) -> Addr:
    """An IP literal and a port; ValueError for anything else — a host name too (it would be resolved on the event
    loop: the CLI resolves the user's own names once, at start)."""
    if not tok.ip_port(text):
        raise ValueError(f"bad address {text[:80]!r} (an IP address and a port expected)")
    host, _, port = text.rpartition(":")
    return sockets.canonical(host.strip("[]")), int(port)


def sendable(addr: Addr) -> bool:
    """Whether a datagram may go to ``addr``. asyncio's UDP transport closes itself for good on any error other
    than OSError — a port over 65535 (OverflowError), a NUL in the host (ValueError) — so one bad address from a
    peer would take this node's only socket down. Such addresses are dropped here instead."""
    host, port = addr[0], addr[1]
    ok = isinstance(host, str) and 0 < len(host) < 256 and "\0" not in host
    return ok and isinstance(port, int) and 0 < port < 65536


def try_addr(text: str) -> Addr | None:
    try:
        return parse_addr(text)
    except ValueError:
        return None


def make_certificate(key: Ed25519PrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, crypto.node_id(key).hex())])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, None)
    )


def _peer_key(quic: QuicConnection) -> NodeId | None:
    """The Ed25519 key of the certificate the peer proved it holds (TLS CertificateVerify), if any."""
    got = quic.get_peercert()
    if got is None:
        return None
    try:
        cert = x509.load_der_x509_certificate(got.public_bytes())
        raw: bytes = cert.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    except (ValueError, TypeError):
        return None
    return raw


def load_identity(cfg: QuicConfiguration, key: Ed25519PrivateKey, cert: x509.Certificate | None = None) -> None:
    """The node's self-signed certificate (``make_certificate``) and its key into a server configuration. Given as
    two PEM texts: qh3 2.1 mangles a certificate and key in one text (the certificate's last line loses its newline;
    a certificate whose base64 has no padding, about 1 in 180, then fails to load: "Incorrect padding")."""
    cert_pem = (cert or make_certificate(key)).public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    cfg.load_cert_chain(cert_pem, key_pem)


class Stream:
    """One bidirectional QUIC stream. ``read()`` returns b"" at the end; ``write()`` sends at once. A tunnel takes
    the data in a callback instead (``set_receiver``): no queue and no task wake-up between QUIC and its socket."""

    def __init__(self, conn: Conn, stream_id: int, kind: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.kind = kind
        self._rx: asyncio.Queue[bytes] = asyncio.Queue()
        self.at_eof = False
        self.bytes_in = 0
        self.bytes_out = 0
        self._fin_in = False
        self._fin_out = False
        self._receiver: Callable[[bytes, bool], None] | None = None

    def set_receiver(self, receiver: Callable[[bytes, bool], None]) -> None:
        """From now on every piece of data, and the end (``True``), goes to ``receiver`` as it arrives, instead of to
        ``read()``; what had arrived before goes to it at once."""
        self._receiver = receiver
        while not self._rx.empty():
            data = self._rx.get_nowait()
            receiver(data, not data)

    async def read(self) -> bytes:
        if self.at_eof and self._rx.empty():
            return b""
        data = await self._rx.get()
        if not data:
            self.at_eof = True
        return data

    def _feed(self, data: bytes, end: bool) -> None:
        fin = end and not self._fin_in
        if fin:
            self._fin_in = True
        if data:
            self.bytes_in += len(data)
        if self._receiver is not None:
            if data or fin:
                self._receiver(data, fin)
        else:
            if data:
                self._rx.put_nowait(data)
            if fin:
                self._rx.put_nowait(b"")
        if fin:
            self._forget_if_done()

    def write(self, data: bytes, end: bool = False) -> None:
        """ConnectionError when the connection is closed or closing (never qh3's own error: a caller writing to
        several peers — gossip — must lose only the one that is gone)."""
        if self.conn.closed.is_set():
            raise ConnectionError("connection closed")
        self.bytes_out += len(data)
        try:
            self.conn.quic.send_stream_data(self.id, data, end_stream=end)
        except QuicConnectionError as e:
            raise ConnectionError(f"connection closing: {e}") from None
        self.conn.transmit()
        if end:
            self._fin_out = True
            self._forget_if_done()

    def _forget_if_done(self) -> None:
        """Both directions finished: QUIC delivers nothing more on this id, so the connection can drop it."""
        if self._fin_in and self._fin_out:
            self.conn.streams.pop(self.id, None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.write(b"", end=True)

    def reset(self, code: int = 0) -> None:
        with contextlib.suppress(Exception):
            self.conn.quic.reset_stream(self.id, code)
            self.conn.transmit()
        if self._receiver is None:
            self._rx.put_nowait(b"")
        elif not self._fin_in:
            self._fin_in = True
            self._receiver(b"", True)


class Quic(QuicConnection):
    """qh3's connection, sending without its per-datagram logging work: with no QUIC logger its
    ``datagrams_to_send`` still parses every packet header it sends, in Python (a sixth of a tunnel sender's time on
    the GPU host). Reads qh3's private ``_core`` / ``_quic_logger`` (qh3 is pinned below 3; the endpoint's tests
    would fail at the first send if they moved)."""

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        core = self._core
        if core is None or self._quic_logger is not None:
            return super().datagrams_to_send(now)
        out = []
        try:
            while (t := core.poll_transmit(now)) is not None:
                out.append((t[0], t[1]))
        except RuntimeError as e:  # as qh3 itself reports a failure of its core
            raise QuicConnectionError(QuicErrorCode.INTERNAL_ERROR, None, str(e)) from e
        return out


class Conn:
    """One QUIC connection to a peer, in either role."""

    def __init__(self, ep: Endpoint, quic: QuicConnection, addr: Addr, is_client: bool, expect: NodeId | None):
        self.ep = ep
        self.quic = quic
        self.addr = addr
        self.is_client = is_client
        via = reach.parse_relayed_addr(addr)
        # the member this connection was made through (None: made directly); see ``shortcut``
        self.relay: NodeId | None = via[0] if via else None
        self.peer: NodeId | None = expect  # pinned when dialling; learned from auth when accepted
        self.authenticated = False
        self.pair_token = b""  # set by the auth (auth.pair_token): relay packets between us carry it
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # a failed handshake nobody waits for any more must not be reported as "never retrieved"
        self.handshake.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.streams: dict[int, Stream] = {}
        self._incoming: asyncio.Queue[Stream | None] = asyncio.Queue()
        self._held: list[Stream] = []
        self._bytes_before_auth = 0
        self._timer: asyncio.TimerHandle | None = None
        self._transmitting = False  # inside transmit(): a write from an event handler asks for another round
        self._again = False
        self._rx: list[bytes] = []  # datagrams of this batch not given to QUIC yet (all from _rx_addr)
        self._rx_addr: Addr = addr
        self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop())

    def __repr__(self) -> str:
        who = crypto.short(self.peer) if self.peer else "?"
        return f"<Conn {who} {self.path} {'out' if self.is_client else 'in'}>"

    @property
    def shortcut(self) -> Addr | None:
        """A relayed connection's punched direct path, once found: its datagrams go there instead."""
        return self.ep.shortcuts.get(self.addr)

    @property
    def is_direct(self) -> bool:
        return self.relay is None or self.shortcut is not None

    def go_direct(self, addr: Addr) -> None:
        """Send this relayed connection's datagrams straight to ``addr`` from now on (QUIC does not notice: it
        keeps seeing the virtual address)."""
        if self.relay is not None:
            self.ep.shortcuts[self.addr] = addr

    @property
    def path(self) -> str:
        r, d = self.relay, self.shortcut
        if r is None:
            return f"direct {sockets.host_port(*self.addr)}"
        if d is not None:
            return f"direct {sockets.host_port(*d)} (punched, first relayed via {crypto.short(r)})"
        return f"relayed via {crypto.short(r)}"

    @property
    def pinned_key(self) -> NodeId | None:
        """The key this connection's peer proved: its TLS certificate's (we dialled) or its auth proof's."""
        return _peer_key(self.quic) if self.is_client else (self.peer if self.authenticated else None)

    # -- streams

    def open_stream(self, kind: int) -> Stream:
        """A new stream of ``kind``; ConnectionError when the connection is closed or closing."""
        if self.closed.is_set():
            raise ConnectionError("connection closed")
        sid = self.quic.get_next_available_stream_id(is_unidirectional=False)
        st = Stream(self, sid, kind)
        self.streams[sid] = st
        st.write(bytes([kind]))
        return st

    async def accept(self) -> Stream | None:
        """The next stream the peer opened (None once the connection closes). Before ``authenticated`` is set
        only the auth stream is handed out; others wait, and too many waiting close the connection."""
        return await self._incoming.get()

    def set_authenticated(self) -> None:
        self.authenticated = True
        for st in self._held:
            self._incoming.put_nowait(st)
        self._held.clear()

    # -- lifecycle

    def close(self, reason: str = "", code: int = 0) -> None:
        if not self.closed.is_set():
            self.close_reason = self.close_reason or reason
            with contextlib.suppress(Exception):
                self.quic.close(error_code=code, reason_phrase=reason[:100])
                self.transmit()
        self._terminated(reason)

    def _terminated(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = self.close_reason or reason
        self.closed.set()
        if not self.handshake.done():
            self.handshake.set_exception(DialError(reason or "connection closed"))
        for st in list(self.streams.values()):
            st._feed(b"", True)
        self._incoming.put_nowait(None)
        if self._timer:
            self._timer.cancel()
        self._keepalive.cancel()
        self.ep._forget(self)

    async def _keepalive_loop(self) -> None:
        while not self.closed.is_set():
            await asyncio.sleep(KEEPALIVE_S)
            with contextlib.suppress(Exception):
                self.quic.send_ping(0)
                self.transmit()

    # -- driving QUIC (qh3)

    @property
    def quic_addr(self) -> Addr:
        """The peer's address as QUIC knows it: a relayed connection has a fixed stand-in (see VIRTUAL_PEER)."""
        return VIRTUAL_PEER if self.relay is not None else self.addr

    def transmit(self) -> None:
        """Send what QUIC has, then hand out its events. An event handler that writes (a tunnel passing data on)
        lands here again: that call only asks for another round, so events are handled in order, one at a time, and
        its datagrams go out with the rest of this round's."""
        if self._transmitting:
            self._again = True
            return
        loop = asyncio.get_running_loop()
        self._transmitting = True
        try:
            self._again = True
            while self._again:
                self._again = False
                out: list[tuple[bytes, Addr]] = []
                for data, path in self.quic.datagrams_to_send(now=loop.time()):
                    addr = (path[0], path[1])  # qh3 gives an IPv6 path as (host, port, flowinfo, scope)
                    if self.relay is not None:
                        addr = self.addr  # the virtual address: _sendto takes it to the relay or the shortcut
                    elif addr != self.addr:
                        # QUIC moved to a new path: the peer's packets come from there now (its NAT rebound). Like
                        # RFC 9000 9.3, the move is made on an authenticated packet and the path is validated after
                        self.addr = addr
                    out.append((data, addr))
                for to, run in sockets.gso_runs(out):  # equal datagrams to one address leave in one send
                    self.ep._send_run(run, to)
                self._process_events()
        finally:
            self._transmitting = False
        if self._timer:
            self._timer.cancel()
            self._timer = None
        t = self.quic.get_timer()
        if t is not None and not self.closed.is_set():
            self._timer = loop.call_at(t, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.quic.handle_timer(now=asyncio.get_running_loop().time())
        self.transmit()

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        """Kept for the end of the batch (``receive``): QUIC takes a batch's datagrams in one call, not one call
        each (at 100 MB/s a tunnel's receiver gets ~80,000 a second)."""
        if self.relay is not None:
            addr = VIRTUAL_PEER  # relayed or on its shortcut: QUIC always sees the one stand-in address
        if self._rx and addr != self._rx_addr:
            self.receive()  # (a batch holds one source address: the peer's path may change mid-batch)
        self._rx.append(data)
        self._rx_addr = addr

    def receive(self) -> None:
        """QUIC takes the datagrams kept so far; the endpoint then calls transmit() once (Endpoint.batch_done)."""
        batch, self._rx = self._rx, []
        now = asyncio.get_running_loop().time()
        if len(batch) == 1:
            self.quic.receive_datagram(batch[0], self._rx_addr, now=now)
        elif batch:
            self.quic.receive_many_datagrams(batch, self._rx_addr, now=now)

    def _process_events(self) -> None:
        while (ev := self.quic.next_event()) is not None:
            if isinstance(ev, events.HandshakeCompleted):
                self._on_handshake()
            elif isinstance(ev, events.StreamDataReceived):
                self._on_stream_data(ev.stream_id, ev.data, ev.end_stream)
            elif isinstance(ev, events.StreamReset):
                st = self.streams.get(ev.stream_id)
                if st:
                    st._feed(b"", True)
            elif isinstance(ev, events.ConnectionIdIssued):
                self.ep._cids[ev.connection_id] = self
            elif isinstance(ev, events.ConnectionIdRetired):
                self.ep._cids.pop(ev.connection_id, None)
            elif isinstance(ev, events.ConnectionTerminated):
                self._terminated(ev.reason_phrase or f"closed (code {ev.error_code})")

    def _on_handshake(self) -> None:
        if self.is_client:
            got = _peer_key(self.quic)
            if got is None or got != self.peer:
                shown = crypto.short(got) if got else "none"
                self.close(f"peer key {shown} is not the node we dialled")
                return
        if not self.handshake.done():
            self.handshake.set_result(None)

    def _on_stream_data(self, sid: int, data: bytes, end: bool) -> None:
        if not self.authenticated:
            # QUIC grants flow-control credit as data arrives, so a peer that never authenticates could park
            # megabytes in our stream queues: cap what it may send first
            self._bytes_before_auth += len(data)
            if self._bytes_before_auth > MAX_BYTES_BEFORE_AUTH:
                self.close("too much data before authentication")
                return
        st = self.streams.get(sid)
        if st is None:
            if not data:
                return
            kind, data = data[0], data[1:]
            st = Stream(self, sid, kind)
            self.streams[sid] = st
            if self.authenticated or (kind in BEFORE_AUTH and not self.is_client):
                self._incoming.put_nowait(st)
            else:
                self._held.append(st)
                if len(self._held) > MAX_HELD_STREAMS:
                    self.close("too many streams before authentication")
                    return
        st._feed(data, end)


@dataclass
class EndpointStats:
    datagrams_in: int = 0
    datagrams_out: int = 0
    control_in: int = 0
    relayed_packets: int = 0  # forwarded for others (we are their relay)
    relayed_bytes: int = 0
    relay_refused: int = 0
    relay_capped: int = 0  # packets over a pair's budget (reach.PairBudget), dropped
    initials_dropped: int = 0  # new connections refused because MAX_PENDING were already waiting


SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104  # Linux (<linux/udp.h>)
_GRO_CMSG = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0
_GSO_OFF = {errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.ENOTSUP}


class UdpSocket:
    """The endpoint's UDP socket, read in batches: every wake-up drains up to ``BATCH`` reads, then the endpoint
    answers once per connection (asyncio's datagram transport reads one datagram per loop iteration, and answering
    each with a full ``datagrams_to_send`` was what capped the tunnel at ~7 MB/s here). Sends go straight out; a
    full send buffer drops the datagram (UDP: QUIC's loss recovery resends) and is counted.

    On Linux a run of equal datagrams to one address leaves in one ``sendmsg`` (UDP GSO: the kernel cuts it), and
    reads take the kernel's coalesced runs whole (UDP GRO); each is still one QUIC datagram to us. Where the kernel
    or the interface refuses segmentation, the socket sends one datagram per call from then on."""

    BATCH = 64

    def __init__(self, sock: socket.socket, ep: Endpoint) -> None:
        self.sock = sock
        self.ep = ep
        self._closing = False
        self.dropped = 0
        self.v6 = sock.family == socket.AF_INET6  # dual stack: IPv4 peers read and are sent to as ::ffff:a.b.c.d
        sock.setblocking(False)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)  # bursts of a full congestion window
        self.gso = self.gro = False
        if sys.platform == "linux" and _GRO_CMSG:
            with contextlib.suppress(OSError):
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            self.gso = True  # until a send says otherwise
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(self.BATCH):
            seg = 0
            try:
                if self.gro:
                    data, anc, _flags, addr = self.sock.recvmsg(65535, _GRO_CMSG)
                    for level, kind, value in anc:
                        if level == SOL_UDP and kind == UDP_GRO and len(value) >= 2:
                            seg = int.from_bytes(value[:2] if len(value) < 4 else value[:4], sys.byteorder)
                else:
                    data, addr = self.sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                continue  # an ICMP error for an earlier send: nothing to do with this read
            host = addr[0]
            if self.v6 and host.startswith("::ffff:") and "." in host:  # an IPv4 peer of a dual-stack socket
                host = host[7:]
            src = (host, addr[1])  # an IPv4 peer reads dotted everywhere
            if 0 < seg < len(data):  # a coalesced run: each segment is one datagram as sent
                for i in range(0, len(data), seg):
                    self.ep.datagram_received(data[i : i + seg], src)
            else:
                self.ep.datagram_received(data, src)
        self.ep.batch_done()

    def is_closing(self) -> bool:
        return self._closing

    def sendto(self, data: bytes, addr: Addr) -> None:
        host = addr[0]
        if self.v6 and ":" not in host:  # IPv4 leaves a dual-stack socket as ::ffff:a.b.c.d
            host = "::ffff:" + host
        try:
            self.sock.sendto(data, (host, addr[1]))
        except (BlockingIOError, InterruptedError):
            self.dropped += 1
        except OSError as e:
            log.debug("sendto %s: %s", addr, e)

    def send_run(self, run: list[bytes], addr: Addr) -> None:
        """Datagrams of one size (the last may be shorter) to one address, in one call where the kernel can."""
        if not self.gso or len(run) < 2:
            for data in run:
                self.sendto(data, addr)
            return
        host = addr[0]
        if self.v6 and ":" not in host:
            host = "::ffff:" + host
        try:
            # the datagrams as they are, one buffer each (the kernel gathers them): no copy into one
            self.sock.sendmsg(run, [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", len(run[0])))], 0,
                              (host, addr[1]))  # fmt: skip
        except (BlockingIOError, InterruptedError):
            self.dropped += len(run)
        except OSError as e:
            if e.errno not in _GSO_OFF:
                log.debug("sendmsg %s: %s", addr, e)
                return
            log.debug("UDP segmentation refused (%s): one datagram per send from now on", e)
            self.gso = False
            self.send_run(run, addr)

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()


class Endpoint:
    """The node's single UDP socket: dial and accept QUIC connections, send and receive control packets."""

    def __init__(
        self,
        key: Ed25519PrivateKey,
        on_accept: Callable[[Conn], Awaitable[None]] | None = None,
        on_control: Callable[[bytes, Addr], None] | None = None,
    ) -> None:
        self.key = key
        self.me = crypto.node_id(key)
        self.on_accept = on_accept
        self.on_control = on_control
        self.transport: UdpSocket | None = None
        self._answer: set[Conn] = set()  # connections that received datagrams in this batch
        self._cids: dict[bytes, Conn] = {}
        self.conns: set[Conn] = set()
        self.shortcuts: dict[Addr, Addr] = {}  # virtual address of a relayed connection -> its punched path
        self.stats = EndpointStats()
        self.relay_server = False  # forward RELAY packets between members we hold authenticated connections with
        self.relay_budget = reach.PairBudget()  # at most this many bytes/s per pair of members (--relay-rate)
        shape = LinkShape.from_env()  # benchmarks only: added latency / rate limit on every datagram we send
        self.shaper = Shaper(shape, self._raw_send) if shape else None
        self._server_cfg = QuicConfiguration(
            is_client=False, alpn_protocols=[ALPN], idle_timeout=IDLE_TIMEOUT_S, connection_id_length=CID_LEN,
            max_data=16 << 20, max_stream_data=4 << 20,
        )  # fmt: skip
        load_identity(self._server_cfg, key)
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self, host: str = "0.0.0.0", port: int = 0) -> Addr:
        """Bind our UDP socket: every interface (the default) is one socket for IPv4 and IPv6 (sockets.py)."""
        try:
            sock = sockets.bound(host, port, socket.SOCK_DGRAM)
        except OSError as e:
            raise MeshError(f"cannot bind UDP {sockets.host_port(host, port)}: {e.strerror}") from None
        self.transport = UdpSocket(sock, self)
        return self.local_addr

    @property
    def ipv6(self) -> bool:
        """Whether our socket reaches IPv6 addresses (it reaches IPv4 ones either way, unless bound to one IPv6)."""
        return self.transport is not None and self.transport.v6

    @property
    def local_addr(self) -> Addr:
        assert self.transport is not None
        h, p = self.transport.sock.getsockname()[:2]
        return str(h), int(p)

    def close(self) -> None:
        for c in list(self.conns):
            c.close("shutting down")
        if self.transport:
            self.transport.close()

    def _sendto(self, data: bytes, addr: Addr) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        via = reach.parse_relayed_addr(addr)
        if via is not None and addr in self.shortcuts:
            addr = self.shortcuts[addr]
        elif via is not None:
            relay = self.direct_member(via[0])
            if relay is None:
                return  # the relay is gone: QUIC sees loss, and the connection times out
            if not relay.pair_token:
                return  # not through the mesh's auth (no token): no relaying
            data, addr = reach.relay_packet(reach.RELAY, via[1], relay.pair_token, data), relay.addr
        self.stats.datagrams_out += 1
        if self.shaper is not None:
            self.shaper.send(data, addr)
        else:
            self._raw_send(data, addr)

    def _send_run(self, run: list[bytes], addr: Addr) -> None:
        """A run from ``Conn.transmit``: in one send where nothing stands between (no relay, no benchmark shaper)."""
        if len(run) < 2 or self.shaper is not None or reach.parse_relayed_addr(addr) is not None:
            for data in run:
                self._sendto(data, addr)
        elif self.transport is not None and not self.transport.is_closing() and sendable(addr):
            self.stats.datagrams_out += len(run)
            self.transport.send_run(run, addr)

    def _raw_send(self, data: bytes, addr: Addr) -> None:
        if self.transport is not None and not self.transport.is_closing() and sendable(addr):
            self.transport.sendto(data, addr)

    def send_control(self, data: bytes, addr: Addr, ttl: int | None = None) -> None:
        """A non-QUIC packet; ``ttl`` (hole punching) sets the IP TTL of this one packet."""
        if not data or data[0] & 0x40:
            raise ValueError("control packets must have bit 0x40 of the first byte clear")
        if ttl is None or self.transport is None:
            self._sendto(data, addr)
            return
        sock = self.transport.sock
        v6 = ":" in addr[0]
        level, opt = (socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS) if v6 else (socket.IPPROTO_IP, socket.IP_TTL)
        default = sock.getsockopt(level, opt)
        sock.setsockopt(level, opt, ttl)
        try:
            self.stats.datagrams_out += 1
            self._raw_send(data, addr)  # an idle UDP transport sends at once, under this TTL (hop limit: IPv6)
        finally:
            sock.setsockopt(level, opt, default)

    def direct_member(self, node: NodeId) -> Conn | None:
        """Our authenticated direct (not relayed) connection to ``node``."""
        for c in self.conns:
            if c.peer == node and c.authenticated and not c.closed.is_set() and c.relay is None:
                return c
        return None

    def _members(self) -> tuple[dict[Addr, reach.Member], dict[NodeId, reach.Place]]:
        at: dict[Addr, reach.Member] = {}
        of: dict[NodeId, reach.Place] = {}
        for c in self.conns:
            if (c.peer is not None and c.authenticated and not c.closed.is_set() and c.relay is None
                    and c.pair_token):  # fmt: skip
                at[c.addr] = (c.peer, c.pair_token)
                of[c.peer] = (c.addr, c.pair_token)
        return at, of

    def _control(self, data: bytes, addr: Addr) -> None:
        if data[0] == reach.RELAY:
            fwd = reach.relay_forward(data, addr, *self._members()) if self.relay_server else None
            if fwd is None:
                self.stats.relay_refused += 1
                return
            if not self.relay_budget.take((addr, fwd[1]), len(fwd[0]), asyncio.get_running_loop().time()):
                self.stats.relay_capped += 1
                return
            self.stats.relayed_packets += 1
            self.stats.relayed_bytes += len(fwd[0])
            self._sendto(*fwd)
            return
        if data[0] == reach.RELAYED:
            p = reach.parse_relay(data)
            relay = self._members()[0].get(addr)
            # only a member we are connected to relays to us, with our connection's token (not a spoofed source)
            if p is None or relay is None or not hmac.compare_digest(p[2], relay[1]):
                self.stats.relay_refused += 1
                return
            self.datagram_received(p[3], reach.relayed_addr(relay[0], p[1]))
            return
        if self.on_control:
            self.on_control(data, addr)

    def _forget(self, conn: Conn) -> None:
        self.conns.discard(conn)
        if not any(c.addr == conn.addr for c in self.conns):
            self.shortcuts.pop(conn.addr, None)
        for cid in [c for c, v in self._cids.items() if v is conn]:
            del self._cids[cid]

    def datagram_received(self, data: bytes, addr: Addr) -> None:
        self.stats.datagrams_in += 1
        if not data:
            return
        if not data[0] & 0x40:
            self.stats.control_in += 1
            self._control(data, addr)
            return
        if not data[0] & 0x80:  # a short header (every packet after the handshake): the CID follows the first byte
            conn = self._cids.get(data[1 : 1 + CID_LEN])
            if conn is not None:
                conn.datagram_received(data, addr)
                self._answer.add(conn)
            return
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CID_LEN)
        except ValueError:
            return
        conn = self._cids.get(header.destination_cid)
        if conn is None:
            if header.packet_type != QuicPacketType.INITIAL or len(data) < MIN_INITIAL or self.on_accept is None:
                return
            if sum(1 for c in self.conns if not c.is_client and not c.authenticated) >= MAX_PENDING:
                self.stats.initials_dropped += 1  # a flood of Initials holds at most MAX_PENDING handshakes
                return
            quic = Quic(
                configuration=self._server_cfg, original_destination_connection_id=header.destination_cid
            )
            conn = Conn(self, quic, addr, is_client=False, expect=None)  # addr: relayed ones arrive as virtual
            self.conns.add(conn)
            self._cids[header.destination_cid] = conn
            self._cids[quic.host_cid] = conn
            task = asyncio.get_running_loop().create_task(self._accept(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        conn.datagram_received(data, addr)
        self._answer.add(conn)

    def batch_done(self) -> None:
        """After a batch of datagrams: each connection that received some sends what it has (ACKs, data) once."""
        answer, self._answer = self._answer, set()
        for conn in answer:
            conn.receive()
            conn.transmit()

    async def _accept(self, conn: Conn) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(conn.handshake), timeout=ACCEPT_TIMEOUT_S)
        except (TimeoutError, DialError):
            conn.close("handshake failed")
            return
        assert self.on_accept is not None
        await self.on_accept(conn)

    async def dial(self, addr: Addr, expect: NodeId, timeout: float = 5.0) -> Conn:
        """A QUIC connection to ``addr`` that is provably ``expect`` (its TLS key), or DialError."""
        cfg = QuicConfiguration(
            is_client=True, alpn_protocols=[ALPN], idle_timeout=IDLE_TIMEOUT_S, connection_id_length=CID_LEN,
            verify_mode=ssl.CERT_NONE, server_name=expect.hex()[:32], max_data=16 << 20, max_stream_data=4 << 20,
            signature_algorithms=[ED25519],
        )  # fmt: skip
        quic = Quic(configuration=cfg)
        conn = Conn(self, quic, addr, is_client=True, expect=expect)
        self.conns.add(conn)
        self._cids[quic.host_cid] = conn
        quic.connect(conn.quic_addr, now=asyncio.get_running_loop().time())
        conn.transmit()
        try:
            await asyncio.wait_for(asyncio.shield(conn.handshake), timeout=timeout)
        except asyncio.CancelledError:
            conn.close("dial cancelled")
            raise
        except TimeoutError:
            conn.close("handshake timed out")
            raise DialError(f"no answer from {sockets.host_port(*addr)} within {timeout:.0f} s") from None
        except DialError as e:
            conn.close(str(e))
            raise DialError(f"{sockets.host_port(*addr)}: {e}") from None
        return conn
