"""What a node runs for the model, and the tunnels that reach it: our rpc-server, the llama-server a plan wants,
the RPC tunnel listeners a host dials its workers through, the HTTP tunnel listeners a node forwards API requests
through, and the byte counts of all of them. It carries out decisions made elsewhere (``proto/serving.py``, the
node's plan) and decides nothing itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import UserError
from meshllm.llama.build import Binaries
from meshllm.llama.processes import ChildFailed
from meshllm.llama.rpcwire import Cmd, WireStats
from meshllm.llama.supervisor import ChildState, LocalServer, RpcServer, ServerConfig, default_threads
from meshllm.net.endpoint import STREAM_HTTP, STREAM_RPC, Conn, Stream
from meshllm.net.meshnet import MeshNet
from meshllm.net.tunnel import TunnelListener, TunnelStats, connect_and_bridge
from meshllm.proto import serving
from meshllm.proto.crypto import NodeId
from meshllm.proto.gossip import ModelFacts, NodeState
from meshllm.proto.planner import Plan, Waiting

log = logging.getLogger("meshllm.hosting")


@dataclass(frozen=True)
class ModelFiles:
    """The model this node has on disk, and how it serves it."""

    path: Path
    facts: ModelFacts
    draft: Path | None = None


class Hosting:
    def __init__(
        self,
        net: MeshNet,
        bins: Binaries | None,
        state_dir: Path,
        ctx_size: int,
        draft_max: int,
        on_listeners: Callable[[], None],
    ) -> None:
        self.net = net
        self.bins = bins
        self.state_dir = state_dir
        self.ctx_size = ctx_size
        self.draft_max = draft_max
        self.on_listeners = on_listeners  # tunnel listeners a plan waited for are up: reconsider it
        self.model: ModelFiles | None = None
        self.device: str | None = None  # our accelerator, as llama.cpp names it (None: CPU only)
        self.rpc: RpcServer | None = None  # our own rpc-server (worker, and the host's last device)
        self.server: LocalServer | None = None  # llama-server, when we host
        self.server_cfg: ServerConfig | None = None
        self.announced = False
        self.generations = 0  # llama-server configurations started (a re-plan that changes it: +1)
        self.rpc_stats: dict[NodeId, TunnelStats] = {}  # per peer
        self.http_stats: dict[NodeId, TunnelStats] = {}
        self.at_load: dict[NodeId, tuple[int, int, int]] = {}  # per worker: weight bytes, round trips, allocated
        self.rpc_listeners: dict[NodeId, TunnelListener] = {}  # host side: one per worker
        self.http_listeners: dict[NodeId, TunnelListener] = {}  # any node: one per remote host
        self._rpc_tunnels: dict[NodeId, set[asyncio.Task[None]]] = {}  # worker side: per dialling host
        self._listener_task: asyncio.Future[TunnelListener] | None = None
        self._rpc_listener_task: asyncio.Future[None] | None = None
        self._reconfig_task: asyncio.Future[None] | None = None

    # ---------------------------------------------------------------- our rpc-server

    async def start_rpc_server(self, model: ModelFiles, device: str | None) -> None:
        """Our rpc-server on loopback, loading weights from our own copy of the model, on ``device`` (llama.cpp's
        name; None: its default). The host uses it as its last device (so the output layer runs here, on the
        host); workers serve it to the host."""
        assert self.bins is not None
        self.model = model
        self.device = device
        self.rpc = RpcServer(self.bins, model.path, self.state_dir, device)
        self.rpc.start()
        try:
            await self.rpc.wait_ready()
        except ChildFailed as e:
            raise UserError(str(e)) from None

    def rpc_up(self) -> bool:
        return self.rpc is not None and self.rpc.alive()

    async def bridge_rpc(self, peer: NodeId, st: Stream) -> None:
        """Worker side, for an admitted peer: its stream to our rpc-server. rpc-server serves one client at a time,
        so tunnels from any other (former) host are closed first."""
        assert self.rpc is not None
        for old, tasks in self._rpc_tunnels.items():
            if old != peer:
                for t in tasks:
                    t.cancel()
        task = asyncio.current_task()
        mine = self._rpc_tunnels.setdefault(peer, set())
        if task is not None:
            mine.add(task)
        try:
            await connect_and_bridge(st, self.rpc.port, self.rpc_stats.setdefault(peer, TunnelStats()))
        finally:
            if task is not None:
                mine.discard(task)

    def drop_stale_tunnels(self, host: NodeId | None) -> None:
        """When the host changes, close every RPC tunnel from another node at once, so the new host's load never
        waits on a dead connection."""
        for peer, tasks in self._rpc_tunnels.items():
            if peer != host:
                for t in list(tasks):
                    t.cancel()

    # ---------------------------------------------------------------- API requests between nodes

    async def on_http_stream(self, conn: Conn, st: Stream) -> None:
        """Host side: a peer's API forwards a request for our model to our llama-server."""
        if self.server is None or self.server.state != ChildState.SERVING or conn.peer is None:
            st.reset()
            return
        await connect_and_bridge(st, self.server.port, self.http_stats.setdefault(conn.peer, TunnelStats()))

    def _opener(self, node: NodeId, kind: int) -> Callable[[], Stream | None]:
        def open_stream() -> Stream | None:
            conn = self.net.peers.get(node)
            if conn is None or conn.closed.is_set():
                return None
            return conn.open_stream(kind)

        return open_stream

    async def _http_listener(self, host: NodeId) -> TunnelListener:
        lst = self.http_listeners.get(host)
        if lst is None:
            lst = TunnelListener(self._opener(host, STREAM_HTTP), self.http_stats.setdefault(host, TunnelStats()))
            await lst.start()
            self.http_listeners[host] = lst  # only once it has a port
        return lst

    def open_http_listener(self, host: NodeId) -> None:
        """In the background: a local port whose connections tunnel to ``host``'s llama-server."""
        if host not in self.http_listeners and (self._listener_task is None or self._listener_task.done()):
            self._listener_task = asyncio.ensure_future(self._http_listener(host))

    # ---------------------------------------------------------------- llama-server

    def reconfigure(self, plan: Plan | Waiting | None, me: NodeId) -> None:
        """Run llama-server as the plan says, restarting it only when its configuration changes."""
        can_host = self.bins is not None and self.model is not None
        w = serving.wanted_server(
            plan, me, can_host, frozenset(self.rpc_listeners), frozenset(self.net.peers), self.device is not None
        )
        if isinstance(w, serving.NeedTunnels):
            if w.missing and (self._rpc_listener_task is None or self._rpc_listener_task.done()):
                self._rpc_listener_task = asyncio.ensure_future(self._make_rpc_listeners(list(w.missing)))
            return  # on_listeners (or the next change) reconfigures
        want: ServerConfig | None = None
        if w is not None:
            assert self.model is not None
            rpc: tuple[str, ...] = ()
            extra: tuple[str, ...] = ()
            if isinstance(w, serving.Split):
                # workers first (the first layers), our own device last: the output layer stays here — through
                # our rpc-server on a CPU host, in-process on a GPU host (llama.cpp lists RPC devices first)
                rpc = tuple(f"127.0.0.1:{self.rpc_listeners[n].port}" for n in w.workers)
                if w.own_rpc:
                    assert self.rpc is not None
                    rpc += (f"127.0.0.1:{self.rpc.port}",)
                extra = ("--load-mode", "none", "--fit", "off")
            want = ServerConfig(
                model=self.model.path, alias=self.model.facts.source, ctx_size=self.ctx_size,
                threads=default_threads(), rpc=rpc, tensor_split=w.tensor_split if isinstance(w, serving.Split) else (),
                extra=extra, draft=self.model.draft, draft_max=self.draft_max, draft_device=self.device,
            )  # fmt: skip
        if want == self.server_cfg:
            return
        self.server_cfg = want
        self._reconfig_task = asyncio.ensure_future(self._restart_server(want))

    async def _make_rpc_listeners(self, nodes: list[NodeId]) -> None:
        for n in nodes:
            if n not in self.rpc_listeners:
                stats = self.rpc_stats.setdefault(n, TunnelStats())
                stats.rpc = stats.rpc or WireStats()
                lst = TunnelListener(self._opener(n, STREAM_RPC), stats)
                await lst.start()
                self.rpc_listeners[n] = lst  # only once it has a port
        self.on_listeners()

    async def _restart_server(self, cfg: ServerConfig | None) -> None:
        old, self.server = self.server, None
        if old:
            await old.stop()
        self.announced = False
        if cfg is None or self.bins is None:
            return
        self.net.update(state=NodeState.LOADING)  # peers stop routing here until we announce "serving" again
        self.server = LocalServer(self.bins, cfg, self.state_dir)
        self.server.start()
        self.generations += 1

    def became_ready(self) -> bool:
        """True once, when our llama-server has started serving: peers then route here (gossip state)."""
        if self.announced or self.server is None or self.server.state != ChildState.SERVING:
            return False
        self.announced = True
        self.net.update(state=NodeState.SERVING)
        # what loading the model cost on each worker's wire (later traffic is per-token inputs)
        self.at_load = {n: _weights_and_trips(st) for n, st in self.rpc_stats.items() if st.rpc is not None}
        return True

    # ---------------------------------------------------------------- counts and shutdown

    def tunnel_counts(self, node: NodeId) -> dict[str, int]:
        rpc = self.rpc_stats.get(node, TunnelStats())
        http = self.http_stats.get(node, TunnelStats())
        # bytes_up: what we sent to that peer through tunnels; bytes_down: what came back from it
        out = {"rpc_sent": rpc.bytes_up, "rpc_received": rpc.bytes_down, "rpc_tunnels": rpc.tunnels,
               "http_sent": http.bytes_up, "http_received": http.bytes_down}  # fmt: skip
        if rpc.rpc is not None:
            out["rpc_local_loads"] = rpc.rpc.commands[Cmd.SET_TENSOR_GGUF]
            if node in self.at_load:
                out["load_weight_bytes"], out["load_round_trips"], out["load_allocated"] = self.at_load[node]
        return out

    async def stop(self) -> None:
        if self.server:
            await self.server.stop()
        if self.rpc:
            await self.rpc.stop()
        for lst in [*self.rpc_listeners.values(), *self.http_listeners.values()]:
            await lst.close()


def _weights_and_trips(st: TunnelStats) -> tuple[int, int, int]:
    assert st.rpc is not None
    return (st.rpc.payload[Cmd.SET_TENSOR] + st.rpc.payload[Cmd.SET_TENSOR_HASH], st.rpc.round_trips,
            st.rpc.allocated)  # fmt: skip
