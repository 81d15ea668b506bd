"""Who reaches our rpc-server (worker side). Anyone whose bytes reach an rpc-server owns that machine, so only the host
this node itself elected gets in: through an RPC tunnel (a QUIC stream from it) or with a key for our rpc-server's
TLS listener, a fresh one for each llama-server it starts, for use from its address alone. rpc-server serves one
client at a time, so the tunnels of a former host close the moment another is elected, and its key is withdrawn.
The decision is ``proto/serving.may_open_rpc``'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from meshllm.llama.supervisor import RpcServer
from meshllm.machine import state
from meshllm.net.conn import Conn, Stream
from meshllm.net.meshnet import MeshNet
from meshllm.net.tunnel import TunnelStats, connect_and_bridge
from meshllm.proto import crypto, serving
from meshllm.proto.crypto import NodeId

log = logging.getLogger("meshllm.hosting")


class RpcGate:
    def __init__(self, net: MeshNet, state_dir: Path, elected: Callable[[], NodeId | None],
                 rpc: Callable[[], RpcServer | None], stats: dict[NodeId, TunnelStats]) -> None:  # fmt: skip
        self.net = net
        self.state_dir = state_dir
        self.elected = elected  # the host this node itself elected (None: none yet)
        self.rpc = rpc  # our rpc-server, when it runs
        self.stats = stats  # per peer: what its tunnels to our rpc-server carried
        self._tunnels: dict[NodeId, set[asyncio.Task[None]]] = {}  # per dialling host
        self._key_holder: NodeId | None = None  # who holds the key our rpc-server's TLS listener accepts now
        self._key_seq = 0

    def _up(self) -> bool:
        rpc = self.rpc()
        return rpc is not None and rpc.alive()

    async def on_stream(self, conn: Conn, st: Stream) -> None:
        """Worker side: only the elected host may reach our rpc-server (anyone reaching it owns the machine)."""
        peer = conn.peer
        if peer is None or not serving.may_open_rpc(peer, self.elected(), self._up()):
            log.info("refused an RPC tunnel from %s: not the elected host", crypto.short(peer) if peer else "?")
            st.reset()
            return
        await self.bridge(peer, st)

    async def on_key_stream(self, conn: Conn, st: Stream) -> None:
        """Worker side: the key of our rpc-server's direct (TLS) listener, for the elected host alone."""
        peer, host = conn.peer, self.elected()
        if peer is None or not serving.may_open_rpc(peer, host, self._up()):
            if peer is None or peer != host:
                # ordinary while an election settles (the host asks before this node agrees): not a warning
                log.info("refused an RPC key to %s: not the elected host", crypto.short(peer) if peer else "?")
            st.reset()
            return
        ip = conn.addr[0] if conn.relay is None else None  # an IPv4 address reads dotted (sockets.py)
        key = self.issue_key(peer, ip)
        with contextlib.suppress(ConnectionError):  # no TLS listener here (--rpc-path tunnel, a build without TLS)
            st.write(key.encode() if key else serving.NO_DIRECT_PATH, end=True)

    async def bridge(self, peer: NodeId, st: Stream) -> None:
        """Worker side, for an admitted peer: its stream to our rpc-server. rpc-server serves one client at a time,
        so tunnels from any other (former) host are closed first."""
        rpc = self.rpc()
        assert rpc is not None
        for old, tasks in self._tunnels.items():
            if old != peer:
                for t in tasks:
                    t.cancel()
        task = asyncio.current_task()
        mine = self._tunnels.setdefault(peer, set())
        if task is not None:
            mine.add(task)
        try:
            await connect_and_bridge(st, rpc.port, self.stats.setdefault(peer, TunnelStats()))
        finally:
            if task is not None:
                mine.discard(task)

    def serve_layers_for(self, host: NodeId | None) -> None:
        """The host we serve layers for changed: our record says so (that host waits for it before it starts its
        llama-server, which we would otherwise refuse); every RPC tunnel from another node closes at once, so the
        new host's load never waits on a dead connection, and a former host's key for the direct path is withdrawn
        (its open connection, if any, ends when its llama-server stops or, if it vanished, by TCP keepalive)."""
        self.net.update(host=host)
        for peer, tasks in self._tunnels.items():
            if peer != host:
                for t in list(tasks):
                    t.cancel()
        if self._key_holder is not None and self._key_holder != host:
            self._key_holder = None
            state.save_rpc_server_key(self.state_dir, "", None)

    def issue_key(self, host: NodeId, ip: str | None = None) -> serving.RpcKey | None:
        """Worker side, for the elected host (the caller checked): a fresh key for our rpc-server's TLS listener,
        for use from ``ip`` only (the host's address on the mesh). It replaces every earlier one, so each
        llama-server the host starts gets its own and nobody else's works. None when our rpc-server has no TLS
        listener."""
        rpc = self.rpc()
        if rpc is None or rpc.tls_port is None:
            return None
        self._key_seq += 1
        key = serving.RpcKey(f"{crypto.short(host)}-{os.getpid()}-{self._key_seq}", os.urandom(32), rpc.tls_port,
                             rpc.peer_port or 0)  # fmt: skip
        state.save_rpc_server_key(self.state_dir, key.identity, key.key, ip)
        self._key_holder = host
        log.info("issued RPC key %s to the host %s", key.identity, crypto.short(host))
        return key
