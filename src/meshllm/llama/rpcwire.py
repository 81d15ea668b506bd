"""The llama.cpp RPC wire (protocol 7.0.0 plus mesh-llm's local-file and worker-to-worker commands), and a counting
relay.

Client to server: ``| cmd u8 | size u64 LE | payload |``; server to client: ``| size u64 LE | data |`` for the
commands that answer. :class:`CountingRelay` sits between llama-server and an rpc-server on loopback and counts
connections, commands, payload bytes per command and blocking round trips; tests and benchmarks use it to show
what crosses the wire.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum


class Cmd(IntEnum):
    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    NONE = 18  # client-internal, never sent
    SET_TENSOR_GGUF = 19  # mesh-llm patch: fill a tensor from the server's own model file
    GGUF_STATUS = 20  # mesh-llm patch: per-buffer result of those loads
    PEER_ACCEPT = 21  # mesh-llm patch 0011: the predecessor this server takes activations from (its address, a key)
    PEER_CONNECT = 22  # mesh-llm patch 0011: connect to the successor's peer listener with a key
    PEER_SEND = 23  # mesh-llm patch 0011: send a tensor to the successor
    PEER_RECV = 24  # mesh-llm patch 0011: write what the predecessor sent into a tensor
    SET_TENSOR_DELTA = 25  # mesh-llm patch 0014: what changed of a compute-buffer input since the last one there


NO_REPLY = frozenset(
    {
        Cmd.FREE_BUFFER,
        Cmd.BUFFER_CLEAR,
        Cmd.SET_TENSOR,
        Cmd.GRAPH_COMPUTE,
        Cmd.INIT_TENSOR,
        Cmd.GRAPH_RECOMPUTE,
        Cmd.MEMSET_TENSOR,
        Cmd.SET_TENSOR_GGUF,
        Cmd.PEER_SEND,
        Cmd.PEER_RECV,
        Cmd.SET_TENSOR_DELTA,
    }
)

HEADER = struct.Struct("<BQ")
CONN_CAPS_SIZE = 24
GGUF_CAPS_MAGIC = b"MLGGUF"

# rpc_tensor, packed: id u64, type u32, buffer u64, ne u32[4], nb u32[4], op u32, op_params i32[16], flags i32,
# src u64[10], view_src u64, view_offs u64, data u64, name char[64], use_count i32  (296 bytes)
RPC_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
assert RPC_TENSOR.size == 296


def pack_rpc_tensor(
    *, ggml_type: int, buffer: int, ne: tuple[int, int, int, int], nb: tuple[int, int, int, int], data: int, name: bytes
) -> bytes:
    return RPC_TENSOR.pack(0, ggml_type, buffer, *ne, *nb, 0, *([0] * 16), 0, *([0] * 10), 0, 0, data, name, 0)


HELLO_REPLY_SIZE = 28


def hello(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> tuple[int, int, int]:
    """Send an RPC HELLO (no capabilities) and return the server's protocol version (major, minor, patch).

    Raises OSError when the connection fails or closes early, ValueError on a reply of the wrong size."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(HEADER.pack(Cmd.HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
        buf = b""
        while len(buf) < 8 + HELLO_REPLY_SIZE:
            chunk = s.recv(64)
            if not chunk:
                raise OSError(f"connection closed after {len(buf)} bytes of the HELLO reply")
            buf += chunk
    (size,) = struct.unpack_from("<Q", buf)
    if size != HELLO_REPLY_SIZE:
        raise ValueError(f"HELLO reply of {size} bytes (want {HELLO_REPLY_SIZE})")
    return buf[8], buf[9], buf[10]


@dataclass
class WireStats:
    connections: int = 0
    commands: Counter[int] = field(default_factory=Counter)
    payload: Counter[int] = field(default_factory=Counter)  # client->server payload bytes per command
    bytes_up: int = 0  # client -> server, everything
    bytes_down: int = 0  # server -> client, everything
    allocated: int = 0  # sum of ALLOC_BUFFER sizes: the memory the client asked the server for

    @property
    def round_trips(self) -> int:
        """Commands the client waited for an answer to."""
        return sum(n for c, n in self.commands.items() if c not in NO_REPLY)

    def minus(self, earlier: WireStats) -> WireStats:
        return WireStats(
            connections=self.connections - earlier.connections,
            commands=self.commands - earlier.commands,
            payload=self.payload - earlier.payload,
            bytes_up=self.bytes_up - earlier.bytes_up,
            bytes_down=self.bytes_down - earlier.bytes_down,
            allocated=self.allocated - earlier.allocated,
        )


class CommandParser:
    """Incremental parser of the client->server stream: counts commands and payload bytes."""

    def __init__(self, stats: WireStats, lock: threading.Lock | None = None) -> None:
        self.stats = stats
        self.lock: contextlib.AbstractContextManager[object] = lock or contextlib.nullcontext()
        self.header = b""
        self.cmd = -1
        self.remaining = 0
        self.alloc = b""  # the payload of an ALLOC_BUFFER being read: u32 device, u64 size

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.remaining > 0:
                take = min(self.remaining, len(view))
                if self.cmd == Cmd.ALLOC_BUFFER and len(self.alloc) + take <= 12:
                    self.alloc += bytes(view[:take])
                self.remaining -= take
                with self.lock:
                    self.stats.payload[self.cmd] += take
                    if self.cmd == Cmd.ALLOC_BUFFER and self.remaining == 0 and len(self.alloc) == 12:
                        self.stats.allocated += struct.unpack_from("<Q", self.alloc, 4)[0]
                view = view[take:]
                continue
            need = HEADER.size - len(self.header)
            self.header += bytes(view[:need])
            view = view[need:]
            if len(self.header) == HEADER.size:
                self.cmd, self.remaining = HEADER.unpack(self.header)
                self.header = b""
                self.alloc = b""
                with self.lock:
                    self.stats.commands[self.cmd] += 1


class CountingRelay:
    """A loopback TCP relay in front of one rpc-server that counts what the RPC client sends and receives.

    Every socket has TCP_NODELAY (a relay without it costs 7x on per-token traffic; see DESIGN.md).
    """

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.stats = WireStats()
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"relay:{self.port}", daemon=True).start()

    def snapshot(self) -> WireStats:
        with self._lock:
            s = self.stats
            return WireStats(
                s.connections, Counter(s.commands), Counter(s.payload), s.bytes_up, s.bytes_down, s.allocated
            )

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.stats.connections += 1
                self._socks += [client, server]
            parser = CommandParser(self.stats, self._lock)
            threading.Thread(target=self._pump, args=(client, server, parser, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, parser: CommandParser | None, up: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if parser is not None:
                    parser.feed(data)
                with self._lock:
                    if up:
                        self.stats.bytes_up += len(data)
                    else:
                        self.stats.bytes_down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> CountingRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
