"""Worker to worker over the mesh, for a split whose workers the host reaches only through tunnels
(behind NATs, through relays, ``--rpc-path tunnel``). The decisions are in ``proto/serving.py``
(``tunnel_peer_entries``, ``may_open_peer``); this is the thin shell.

- Host: before it starts llama-server it asks each worker (a STREAM_PEER_OPEN stream) for a loopback port on that
  worker's machine that leads to the next worker; ``GGML_RPC_PEERS`` then names those ports (patch 0011).
- Worker A (the sender): answers only its elected host; the port is a TunnelListener (loopback, our own user's
  processes only) whose connections go out as STREAM_PEER streams to the next worker B.
- Worker B (the receiver): takes a STREAM_PEER stream only from the worker right before it in its elected host's
  plan, and bridges it to its rpc-server's predecessor listener on loopback. The bytes inside are TLS with the key
  the host's llama-server made for that pair (as on the direct path): the mesh only carries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from meshllm.net.conn import STREAM_PEER, STREAM_PEER_OPEN, Conn, Stream
from meshllm.net.meshnet import MeshNet
from meshllm.net.tunnel import TunnelListener, TunnelStats, connect_and_bridge
from meshllm.proto import crypto, serving
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import Plan, Waiting

log = logging.getLogger("meshllm.peerlinks")

ASK_TIMEOUT_S = 5.0
PLAN_WAIT_S = 5.0  # a receiver whose plan lags the host's waits this long for it (the sender's TLS waits 10 s)
Pair = tuple[NodeId, NodeId]


class PeerLinks:
    def __init__(
        self,
        net: MeshNet,
        elected: Callable[[], NodeId | None],
        plan: Callable[[], Plan | Waiting | None],
        peer_port: Callable[[], int | None],
        opener: Callable[[NodeId, int], Callable[[], Stream | None]],
        on_ready: Callable[[], None],
    ) -> None:
        self.net = net
        self.elected = elected  # the host this node elected itself
        self.plan = plan  # this node's current plan
        self.peer_port = peer_port  # our rpc-server's listener for its predecessor (None: it has none)
        self.opener = opener
        self.on_ready = on_ready  # forwarders a plan waited for are known: reconsider it
        self.stats = TunnelStats()  # hidden states through the mesh, both ways, worker side
        # host side: (a, b) -> the port on a's machine that leads to b; pairs asked and not given
        self.ports: dict[Pair, int] = {}
        self.refused: set[Pair] = set()
        self._asking: asyncio.Future[None] | None = None
        # worker side: the next worker -> our forwarder to it
        self.forwarders: dict[NodeId, TunnelListener] = {}
        self._tasks: set[asyncio.Future[None]] = set()

    # ---------------------------------------------------------------- host side

    def ports_for(self, workers: tuple[NodeId, ...]) -> dict[Pair, int] | None:
        """The forwarders known for the split's neighbouring pairs; None while some are still being asked for (we
        call ``on_ready`` when the answers are in). A pair a worker refused is left out (the split keeps the star)."""
        pairs = [p for p in itertools.pairwise(workers) if p not in self.ports and p not in self.refused]
        if pairs:
            if self._asking is None or self._asking.done():
                self._asking = asyncio.ensure_future(self._ask_all(pairs))
            return None
        return {p: self.ports[p] for p in itertools.pairwise(workers) if p in self.ports}

    async def _ask_all(self, pairs: list[Pair]) -> None:
        answers = await asyncio.gather(*(self._ask(a, b) for a, b in pairs))
        for pair, port in zip(pairs, answers, strict=True):
            if port:
                self.ports[pair] = port
            else:
                self.refused.add(pair)
                log.info("no link from %s to %s through the mesh: the star", *map(crypto.short, pair))
        self.on_ready()

    async def _ask(self, a: NodeId, b: NodeId) -> int:
        """``a``'s port that leads to ``b``; 0 when it gives none. A worker whose view of the election lags ours
        refuses for a moment (as with the direct path's key): asked again until ASK_TIMEOUT_S have passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ASK_TIMEOUT_S
        while True:
            conn = self.net.peers.get(a)
            if conn is None or conn.closed.is_set():
                return 0
            raw = b""
            try:
                st = conn.open_stream(STREAM_PEER_OPEN)
                st.write(b, end=True)
                async with asyncio.timeout(max(0.1, deadline - loop.time())):
                    while len(raw) < 8 and (chunk := await st.read()):
                        raw += chunk
            except (TimeoutError, ConnectionError):
                pass
            if len(raw) == 2:
                return int.from_bytes(raw, "big")
            if loop.time() + 0.5 > deadline:
                return 0
            await asyncio.sleep(0.5)

    def forget(self, nodes: Iterable[NodeId]) -> None:
        """Those nodes died, left or restarted: their forwarders are gone or elsewhere; ask afresh."""
        gone = set(nodes)
        for pair in [p for p in [*self.ports, *self.refused] if gone & set(p)]:
            self.ports.pop(pair, None)
            self.refused.discard(pair)

    # ---------------------------------------------------------------- worker side

    async def on_open(self, conn: Conn, st: Stream) -> None:
        """The elected host asks for a loopback port here that leads to the worker after us."""
        host = conn.peer
        if host is None or host != self.elected():
            log.warning("refused a worker-to-worker link asked by %s: not the elected host",
                        crypto.short(host) if host else "?")  # fmt: skip
            st.reset()
            return
        raw = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(ASK_TIMEOUT_S):
                while len(raw) <= crypto.NODE_ID_LEN and (chunk := await st.read()):
                    raw += chunk
        succ = raw if len(raw) == crypto.NODE_ID_LEN else None
        if succ is None or succ == self.net.me or succ not in self.net.peers:
            st.reset()
            return
        for other in [n for n in self.forwarders if n != succ]:  # a worker feeds one successor at a time
            old = self.forwarders.pop(other)
            self._spawn(old.close())
        lst = self.forwarders.get(succ)
        if lst is None:
            lst = TunnelListener(self.opener(succ, STREAM_PEER), self.stats)
            await lst.start()
            self.forwarders[succ] = lst
        with contextlib.suppress(ConnectionError):
            st.write(lst.port.to_bytes(2, "big"), end=True)

    async def on_peer(self, conn: Conn, st: Stream) -> None:
        """A hidden state from the worker before us: to our rpc-server's predecessor listener, if it is that worker."""
        peer, port = conn.peer, self.peer_port()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PLAN_WAIT_S

        def allowed() -> bool:
            return port is not None and serving.may_open_peer(peer, self.net.me, self.plan(), self.elected())

        while not allowed() and loop.time() < deadline:  # our plan may lag the host's by a moment: wait for it
            await asyncio.sleep(0.1)
        if port is None or not allowed():
            log.warning("refused a worker-to-worker stream from %s: not the worker before us in our host's plan",
                        crypto.short(peer) if peer else "?")  # fmt: skip
            st.reset()
            return
        await connect_and_bridge(st, port, self.stats)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for lst in self.forwarders.values():
            await lst.close()
        self.forwarders.clear()
