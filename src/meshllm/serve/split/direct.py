"""The direct RPC path, host side: our llama-server reaches a worker's rpc-server over TCP + TLS 1.3 where it can —
a key the worker hands its elected host over the mesh, then a TCP connection to the address the mesh knows it at —
and through the worker's tunnel otherwise. A path that broke is not tried again for a while (``DIRECT_RETRY_S``);
a worker that died or left is forgotten, so when it comes back its path is probed afresh. The decisions are
``proto/serving.py``'s (``try_direct``, ``RpcKey``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from meshllm.llama.build import Binaries
from meshllm.llama.processes import speaks_tls
from meshllm.net.conn import STREAM_RPC_KEY
from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto, serving
from meshllm.proto.crypto import NodeId
from meshllm.sockets import host_port

log = logging.getLogger("meshllm.hosting")


class DirectPaths:
    def __init__(self, net: MeshNet, bins: Binaries | None, mode: str) -> None:
        self.net = net
        self.bins = bins
        self.mode = mode  # "auto" or "tunnel" (--rpc-path)
        self.at: dict[NodeId, str] = {}  # worker -> "ip:port" of its rpc-server's TLS listener, when probed reachable
        self.peer_at: dict[NodeId, str] = {}  # worker -> "ip:port" of its rpc-server's predecessor listener (0011)
        self.failed: dict[NodeId, float] = {}  # worker -> monotonic time until which we do not retry

    async def ask_key(self, worker: NodeId) -> serving.RpcKey | bool | None:
        """The worker's answer: a key; False when it has no direct path to give (it said so: no use asking again);
        None when it refused or did not answer (perhaps not yet: its view of the election may lag ours)."""
        conn = self.net.peers.get(worker)
        if conn is None or conn.closed.is_set():
            return None
        try:
            st = conn.open_stream(STREAM_RPC_KEY)
            st.write(b"", end=True)
            raw = b""
            async with asyncio.timeout(5.0):
                while len(raw) < 4096:
                    chunk = await st.read()
                    if not chunk:
                        break
                    raw += chunk
        except (TimeoutError, ConnectionError):
            return None
        if raw == serving.NO_DIRECT_PATH:
            return False
        return serving.RpcKey.decode(raw)

    async def probe(self, worker: NodeId) -> None:
        """Whether our llama-server can reach ``worker``'s rpc-server directly: a key (the worker answers only its
        elected host, and only with TLS), then a TCP connection to the address the mesh knows it at."""
        conn = self.net.peers.get(worker)
        if conn is None or self.bins is None:
            return
        ip = conn.addr[0]
        tls_here = speaks_tls(self.bins.rpc_server)
        if not serving.try_direct(
            self.mode, tls_here, conn.relay is None, ip, self.failed.get(worker), time.monotonic()
        ):
            return
        key: serving.RpcKey | bool | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):  # a worker whose view of the election lags ours refuses for a moment
                while (key := await self.ask_key(worker)) is None:
                    await asyncio.sleep(0.5)
        if not isinstance(key, serving.RpcKey):
            why = "it offers none" if key is False else "no key"
            log.info("no direct RPC path to %s (%s): tunnel", crypto.short(worker), why)
            return
        try:
            async with asyncio.timeout(2.0):
                _, w = await asyncio.open_connection(ip, key.port)
            w.close()
        except (OSError, TimeoutError):
            log.info("no direct RPC path to %s (%s unreachable): tunnel", crypto.short(worker), host_port(ip, key.port))
            return
        self.at[worker] = host_port(ip, key.port)
        if key.peer:
            self.peer_at[worker] = host_port(ip, key.peer)
        log.info("direct RPC path to %s: %s (TLS)", crypto.short(worker), self.at[worker])

    def broke(self, worker: NodeId, why: str) -> None:
        ep = self.at.pop(worker, None)
        self.failed[worker] = time.monotonic() + serving.DIRECT_RETRY_S
        log.warning("%s at %s: %s; through its tunnel while it stays a member (a worker that is gone leaves the plan "
                    "instead)", crypto.short(worker), ep, why)  # fmt: skip

    def forget(self, node: NodeId) -> None:
        """``node`` died or left: its endpoint and any failure of its path go (its death was no fault of the path)."""
        self.at.pop(node, None)
        self.peer_at.pop(node, None)
        self.failed.pop(node, None)
