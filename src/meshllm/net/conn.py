"""QUIC connections between members, in either role, on an endpoint's socket (``net/endpoint.py``): each one a
qh3 ``QuicConnection`` driven here, its typed streams, and the node identity its TLS proves.

Identity: each node's TLS certificate is self-signed with its Ed25519 node key. The dialler checks after the
handshake that the certificate's key is the NodeId it meant to reach (TLS already checked that the peer holds
that key: CertificateVerify), and closes otherwise. The listener learns the dialler's key from the auth stream.

Streams are typed: the opener's first byte says what the stream is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Callable
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID
from qh3.quic import events
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection, QuicConnectionError
from qh3.quic.packet import QuicErrorCode

from meshllm import sockets
from meshllm.errors import MeshError
from meshllm.proto import crypto, reach
from meshllm.proto.crypto import NodeId

log = logging.getLogger("meshllm.net")
# qh3 logs every close by a peer as a warning; a node's own lines say when a peer leaves and why (Conn.close_reason)
logging.getLogger("quic").setLevel(logging.ERROR)

ALPN = "mesh-llm/1"
CID_LEN = 8
IDLE_TIMEOUT_S = 20.0
KEEPALIVE_S = 7.0
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
STREAM_KNOCK = 7  # a node with no token asks to join (proto/knock.py): answered, never authenticated
STREAM_PEER_OPEN = 8  # the host asks a worker for a loopback port leading to the next worker (serve/split/peerlinks.py)
STREAM_PEER = 9  # a worker's hidden state to the next worker's rpc-server (worker to worker over the mesh)
STREAM_KINDS = {
    STREAM_AUTH: "auth", STREAM_GOSSIP: "gossip", STREAM_RPC: "rpc", STREAM_HTTP: "http", STREAM_RPC_KEY: "rpc-key",
    STREAM_FETCH: "fetch", STREAM_KNOCK: "knock", STREAM_PEER_OPEN: "peer-open", STREAM_PEER: "peer",
}  # fmt: skip
BEFORE_AUTH = (STREAM_AUTH, STREAM_KNOCK)  # the streams a listener hands out before a connection is authenticated
MAX_HELD_STREAMS = 8
MAX_BYTES_BEFORE_AUTH = 256 << 10  # an auth proof is a few hundred bytes: anything near this is not one

Addr = tuple[str, int]


class DialError(MeshError):
    pass


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


class Home(Protocol):
    """What a connection needs of the endpoint whose socket it uses (``net/endpoint.Endpoint``)."""

    shortcuts: dict[Addr, Addr]
    _cids: dict[bytes, Conn]

    def _send_run(self, run: list[bytes], addr: Addr) -> None: ...

    def _forget(self, conn: Conn) -> None: ...


class Conn:
    """One QUIC connection to a peer, in either role."""

    def __init__(self, ep: Home, quic: QuicConnection, addr: Addr, is_client: bool, expect: NodeId | None):
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
