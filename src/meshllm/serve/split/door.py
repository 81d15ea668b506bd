"""API requests between nodes. A node whose API gets a request for a model another node serves sends it through an
HTTP tunnel listener to that node (a local port whose connections become QUIC streams, ``open_listener``); the node
that serves it takes the stream at its door — an API of its own on loopback that passes the API's endpoints only,
capped as the API caps them, to its own llama-server only — never llama-server's own port. A member (with the keys it
minted for itself) holds at most DOOR_PER_MEMBER connections through the door at once, and its requests count as
that member's for the fair share of slots."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meshllm.net.conn import STREAM_HTTP, Conn, Stream
from meshllm.net.meshnet import MeshNet
from meshllm.net.tunnel import TunnelListener, TunnelStats, connect_and_bridge
from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.serve.http.api import Api, Router

DOOR_PER_MEMBER = 64  # connections one member (with the keys it minted) may hold open through our door at once

Opener = Callable[[NodeId, int], Callable[[], Stream | None]]  # a peer and a stream kind -> opens one such stream


class Door:
    def __init__(self, net: MeshNet, opener: Opener, serving: Callable[[], bool]) -> None:
        self.net = net
        self._opener = opener
        self._serving = serving  # whether our llama-server serves now (else a stream at the door is reset)
        self.api: Api | None = None  # the door itself (open)
        self.port = 0
        self.sources: dict[int, str] = {}  # the door's client port -> the member whose request it bridges
        self.open_per: dict[str, int] = {}  # the door's connections open per member (DOOR_PER_MEMBER at most)
        self.stats: dict[NodeId, TunnelStats] = {}  # per peer, both ways
        self.listeners: dict[NodeId, TunnelListener] = {}  # one per remote host we send requests to
        self._tasks: dict[NodeId, asyncio.Future[TunnelListener]] = {}  # per host: its listener being made

    async def open(self, local: Router, models: Callable[[], list[str]], max_tokens: int | None,
                   slot_ctx: Callable[[], int | None]) -> None:  # fmt: skip
        """The door on loopback, routing to ``local`` (our own llama-server) only."""
        self.api = Api(local, models, lambda: {}, max_tokens=max_tokens, door=True, source_of=self._source,
                       slot_ctx=slot_ctx)  # fmt: skip
        self.port = await self.api.start("127.0.0.1", 0)

    async def on_stream(self, conn: Conn, st: Stream) -> None:
        """Host side: a peer's API forwards a request for our model, through our door, to our llama-server."""
        if not self._serving() or conn.peer is None or not self.port:
            st.reset()
            return
        who = self.accountable(conn.peer)
        if self.open_per.get(who, 0) >= DOOR_PER_MEMBER:  # a member (its minted keys with it) holds its share
            st.reset()
            return
        self.open_per[who] = self.open_per.get(who, 0) + 1
        try:
            await connect_and_bridge(st, self.port, self.stats.setdefault(conn.peer, TunnelStats()), self.sources,
                                     who)  # fmt: skip
        finally:
            if (n := self.open_per.pop(who, 1) - 1) > 0:
                self.open_per[who] = n

    def accountable(self, peer: NodeId) -> str:
        """Whom a peer's requests at our door count as (``adm.accountable``): keys a member minted for itself are
        that member, for the fair share of slots and for the door's connections."""
        core_ = self.net.core
        chain = core_.table.chain_of(peer) if core_ is not None else None
        if chain is None:
            return f"node {crypto.short(peer)}"
        admins = {n for n in core_.table.admins if n not in core_.table.revoked} if core_ is not None else set()
        return f"member {crypto.short(adm.accountable(chain, admins))}"

    def _source(self, client_port: int) -> str:
        """Whose request came through the door on this connection (the fair share of slots is per peer)."""
        return self.sources.get(client_port, "node ?")

    async def _listener(self, host: NodeId) -> TunnelListener:
        lst = self.listeners.get(host)
        if lst is None:
            lst = TunnelListener(self._opener(host, STREAM_HTTP), self.stats.setdefault(host, TunnelStats()))
            await lst.start()
            self.listeners[host] = lst  # only once it has a port
        return lst

    def open_listener(self, host: NodeId) -> None:
        """In the background: a local port whose connections tunnel to ``host``'s door."""
        task = self._tasks.get(host)
        if host not in self.listeners and (task is None or task.done()):
            self._tasks[host] = asyncio.ensure_future(self._listener(host))

    async def stop(self) -> None:
        if self.api:
            await self.api.stop()
        for lst in self.listeners.values():
            await lst.close()
