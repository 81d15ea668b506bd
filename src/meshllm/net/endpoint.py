"""One UDP socket per node carrying QUIC connections in both roles, and room for non-QUIC control packets.

QUIC is qh3's sans-IO ``QuicConnection`` (an aioquic fork whose connection core is native code: 4x aioquic's
throughput through a tunnel here, half its round-trip time; README, "On GPUs"). Its own ``connect()``/``serve()``
each make a socket; here we drive ``QuicConnection`` ourselves and demultiplex by connection id. A datagram whose
first byte has bit 0x40 clear is not QUIC (every QUIC v1 packet sets that bit): hole-punch probes go to
``on_control``; RELAY packets are forwarded when this node relays (``relay_server``); RELAYED packets are unwrapped
and belong to the connection whose virtual address names the relay and the peer (see proto/reach.py; QUIC itself
sees a fixed stand-in address, ``VIRTUAL_PEER``), so a relayed connection is an ordinary QUIC connection,
end to end, whose datagrams happen to travel through a member.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import socket
import ssl
import struct
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from qh3._hazmat import Buffer
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.packet import QuicPacketType, pull_quic_header

from meshllm import sockets
from meshllm.errors import MeshError
from meshllm.net.conn import ALPN, CID_LEN, ED25519, IDLE_TIMEOUT_S, Addr, Conn, DialError, Quic, load_identity
from meshllm.net.netem import LinkShape, Shaper
from meshllm.proto import crypto, reach
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId

log = logging.getLogger("meshllm.net")

SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104  # Linux (<linux/udp.h>)
_GRO_CMSG = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0
_GSO_OFF = {errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.ENOTSUP}
MIN_INITIAL = 1200
MAX_PENDING = 64  # incoming connections not yet authenticated; more Initials are dropped until some finish
ACCEPT_TIMEOUT_S = 10.0  # an incoming handshake that has not completed by then is dropped


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
