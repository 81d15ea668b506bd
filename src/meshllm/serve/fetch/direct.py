"""The direct path for fetches: TCP + TLS 1.3 between two members, where the QUIC connection between them
is direct (not relayed). QUIC streams in Python moved a model at ~60 MB/s on this machine's loopback
(``benchmarks/fetch.py``); a TLS socket moves it at what the disk, the hashing and the kernel allow.

The source runs a TLS listener with a certificate it makes at start (never written anywhere but its state dir,
0600). A member asks it for a ticket over the mesh (an authenticated QUIC stream): the listener's port, the SHA-256
of that certificate, and 32 random bytes bound to the asking member, good for ``TICKET_S``. The fetcher connects,
checks the certificate's hash (so it talks to the member that answered over the mesh, and the bytes are encrypted
to it), and sends the ticket first; the listener reads nothing else until a ticket it issued arrives (anyone else
is cut after 32 bytes or 5 s). Then requests, one at a time per connection: 4-byte length + msgpack
``[fingerprint, index]``; answers: 8-byte length + the chunk (length 0: refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshllm import sockets
from meshllm.paths import write_private
from meshllm.proto.crypto import NodeId
from meshllm.sockets import host_port

log = logging.getLogger("meshllm.fetch")
TICKET_S = 600.0
TICKET_LEN = 32
HELLO_TIMEOUT_S = 5.0
MAX_TICKETS = 1024

Chunk = Callable[[NodeId, str, int], Awaitable[bytes | None]]  # (peer, fingerprint, index) -> the chunk, or None


def _self_signed(state_dir: Path) -> tuple[Path, Path, str]:
    """A fresh key and certificate for this run's listener: their files and the certificate's SHA-256 (hex)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mesh-llm fetch")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30)).sign(key, hashes.SHA256()))  # fmt: skip
    d = state_dir / "fetch-tls"
    key_path, cert_path = d / "key.pem", d / "cert.pem"
    write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))  # fmt: skip
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


class DirectSource:
    """The source's TLS listener."""

    def __init__(self, state_dir: Path, host: str, chunk: Chunk) -> None:
        self.state_dir, self.host, self.chunk = state_dir, host, chunk
        self.port = 0
        self.cert_hash = ""
        self._tickets: dict[bytes, tuple[NodeId, float]] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        cert, key, self.cert_hash = await asyncio.to_thread(_self_signed, self.state_dir)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(cert, key)
        sock = sockets.bound(self.host, 0, socket.SOCK_STREAM)  # every interface: IPv4 and IPv6 on one port
        self._server = await asyncio.start_server(self._client, sock=sock, ssl=ctx,
                                                  ssl_handshake_timeout=HELLO_TIMEOUT_S)  # fmt: skip
        self.port = self._server.sockets[0].getsockname()[1]

    def ticket(self, peer: NodeId, now: float) -> bytes:
        """For ``peer`` (the caller checked it is a member on an authenticated connection): where to connect, what
        certificate to expect, and the bytes to send first."""
        for t, (_, until) in list(self._tickets.items()):
            if until <= now:
                del self._tickets[t]
        while len(self._tickets) >= MAX_TICKETS:
            del self._tickets[next(iter(self._tickets))]
        t = os.urandom(TICKET_LEN)
        self._tickets[t] = (peer, now + TICKET_S)
        return msgpack.packb({"port": self.port, "cert": self.cert_hash, "ticket": t})

    def _holder(self, t: bytes, now: float) -> NodeId | None:
        for known, (peer, until) in self._tickets.items():
            if hmac.compare_digest(known, t) and until > now:
                return peer
        return None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                t = await reader.readexactly(TICKET_LEN)
            peer = self._holder(t, time.monotonic())
            if peer is None:
                log.warning("refused a direct fetch connection from %s: no ticket of ours",
                            writer.get_extra_info("peername"))  # fmt: skip
                return
            while True:
                n = struct.unpack("<I", await reader.readexactly(4))[0]
                if n > 256:
                    return
                try:
                    fp, index = msgpack.unpackb(await reader.readexactly(n))
                except (ValueError, TypeError, msgpack.UnpackException):
                    return
                data = await self.chunk(peer, fp, index) if isinstance(fp, str) and isinstance(index, int) else None
                writer.write(struct.pack("<Q", len(data or b"")))
                if data:
                    writer.write(data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ssl.SSLError, OSError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


class DirectLink:
    """One TLS connection from a fetcher to a source, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, ip: str, raw_ticket: bytes, timeout: float = 5.0) -> DirectLink | None:
        """A connection to the source that handed out ``raw_ticket``, its certificate checked; None where the
        ticket is malformed or the path does not work (the QUIC stream serves then)."""
        try:
            d = msgpack.unpackb(raw_ticket)
            port, cert, t = d["port"], d["cert"], d["ticket"]
        except (ValueError, TypeError, KeyError, msgpack.UnpackException):
            return None
        if not (isinstance(port, int) and 0 < port < 65536 and isinstance(cert, str) and isinstance(t, bytes)
                and len(t) == TICKET_LEN):  # fmt: skip
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # its certificate is checked by hash below: the one the member named
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(ip, port, ssl=ctx)
        except (OSError, TimeoutError, ssl.SSLError):
            return None
        ssl_obj = writer.get_extra_info("ssl_object")
        der = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
        if der is None or not hmac.compare_digest(hashlib.sha256(der).hexdigest(), cert):
            log.warning("a direct fetch connection to %s showed another certificate: not used", host_port(ip, port))
            writer.close()
            return None
        writer.write(t)
        return cls(reader, writer)

    async def get(self, fp: str, index: int, most: int, timeout: float) -> bytes | None:
        """Chunk ``index``; None when refused, too long, too slow or cut (the link is useless then: closed)."""
        req = msgpack.packb([fp, index])
        try:
            self.writer.write(struct.pack("<I", len(req)) + req)
            async with asyncio.timeout(timeout):
                n = struct.unpack("<Q", await self.reader.readexactly(8))[0]
                if 0 < n <= most:
                    return await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ssl.SSLError, OSError):
            pass
        self.close()
        return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
