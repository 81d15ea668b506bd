"""What a node runs for the model, and the paths that reach it: our rpc-server, the llama-server a plan wants,
the way a host reaches each worker's rpc-server — directly (TCP + TLS 1.3 with a key the worker hands its elected
host over the mesh) or through an RPC tunnel listener (a QUIC stream) — the HTTP tunnel listeners a node forwards
API requests through, and the byte counts of all of them. It carries out decisions made elsewhere
(``proto/serving.py``, the node's plan) and decides nothing itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from meshllm.errors import UserError
from meshllm.llama.build import Binaries
from meshllm.llama.processes import ChildFailed, Tuning
from meshllm.llama.rpcwire import Cmd, CommandParser, WireStats
from meshllm.llama.supervisor import ChildState, LocalServer, RpcServer, ServerConfig, default_threads
from meshllm.machine import state
from meshllm.net.conn import (
    STREAM_FETCH,
    STREAM_HTTP,
    STREAM_PEER,
    STREAM_PEER_OPEN,
    STREAM_RPC,
    STREAM_RPC_KEY,
    Stream,
)
from meshllm.net.meshnet import MeshNet
from meshllm.net.netem import LinkShape
from meshllm.net.tunnel import TunnelListener, TunnelStats
from meshllm.proto import crypto, serving
from meshllm.proto.capacity import first_device
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import Plan, Waiting
from meshllm.proto.record import MAX_WHY, ModelFacts, NodeState
from meshllm.proto.serving import LAYER_WAIT_S
from meshllm.proto.sizing import BASE_CTX, Sizing
from meshllm.serve.fetch.modelfiles import ModelFiles
from meshllm.serve.fetch.sharing import Sharing
from meshllm.serve.http.slotgate import SlotGate
from meshllm.serve.http.upstream import Unavailable, Upstream
from meshllm.serve.split.direct import DirectPaths
from meshllm.serve.split.door import Door
from meshllm.serve.split.peerlinks import PeerLinks
from meshllm.serve.split.rpcgate import RpcGate

log = logging.getLogger("meshllm.hosting")

RESTART_GRACE_S = 1.0  # a llama-server the plan replaces gets this long after SIGTERM, then SIGKILL


class Hosting:
    def __init__(
        self,
        net: MeshNet,
        bins: Binaries | None,
        state_dir: Path,
        tuning: Tuning,
        queue: int | None,
        draft_max: int,
        on_listeners: Callable[[], None],
        elected: Callable[[], NodeId | None],
        rpc_path: str = "auto",
        rpc_port: int | None = None,
    ) -> None:
        self.net = net
        self.bins = bins
        self.state_dir = state_dir
        self.tuning = tuning
        self.sizing = Sizing(1, BASE_CTX)  # the slots and context the plan gives llama-server (replanning.py)
        self.slots = SlotGate(1, queue)  # every completion for our llama-server waits here for a slot
        self.draft_max = draft_max
        self.on_listeners = on_listeners  # tunnel listeners a plan waited for are up: reconsider it
        self.elected = elected  # the host this node itself elected (None: none yet)
        self.model: ModelFiles | None = None
        self.device: str | None = None  # our accelerators, as llama.cpp names them, comma-separated (None: CPU only)
        self.rpc: RpcServer | None = None  # our own rpc-server (worker, and the host's last device)
        self.server: LocalServer | None = None  # llama-server, when we host
        self.server_cfg: ServerConfig | None = None
        self.announced = False
        self._recovering = False  # llama-server crashed and restarts with the same configuration
        self.generations = 0  # llama-server configurations started (a re-plan that changes it: +1)
        self.crashes = 0  # llama-server deaths we did not cause, over every configuration
        self.say: Callable[[str, str], None] | None = None  # a line for the terminal and the timeline (node._say)
        self.sharing: Sharing | None = None  # our model file, for members that fetch it (serve/fetch/fetching.py)
        self.rpc_stats: dict[NodeId, TunnelStats] = {}  # per peer
        self.rpc_wire: dict[NodeId, WireStats] = {}  # per worker: what our llama-server asked of it through tunnels
        self.at_load: dict[NodeId, tuple[int, int, int]] = {}  # per worker: weight bytes, round trips, allocated
        self.rpc_listeners: dict[NodeId, TunnelListener] = {}  # host side: one per worker
        # API requests between nodes: our door, and our listeners to other nodes' doors (door.py)
        self.door = Door(net, self._opener, lambda: self.server is not None and self.server.state == ChildState.SERVING)
        self._rpc_listener_task: asyncio.Future[None] | None = None
        self._reconfig_task: asyncio.Future[None] | None = None
        self.rpc_port = rpc_port  # our rpc-server's TLS listener port (--rpc-port; None: any free one)
        self.paths = DirectPaths(net, bins, rpc_path)  # the direct RPC path to each worker (host side: direct.py)
        self._facts_of: LocalServer | None = None  # the llama-server whose log ``_facts`` were read from
        self._facts = serving.LogFacts(frozenset(), None)
        self._direct_in_cfg: dict[NodeId, str] = {}  # the direct workers of the configuration being started
        self._closing: set[asyncio.Future[None]] = set()  # listeners of workers that are gone, closing
        self._layer_wait = serving.LayerWait()  # workers still fetching their layers, that a split waits for
        self._host_wait = serving.LayerWait(serving.HOST_WAIT_S)  # workers that have not elected us yet, the same
        self._probed_as: dict[NodeId, int] = {}  # worker -> its incarnation when we made its listener and probed
        # worker side: who may reach our rpc-server, through a tunnel or with a key for its TLS listener (rpcgate.py)
        self.gate = RpcGate(net, state_dir, elected, lambda: self.rpc, self.rpc_stats)
        self.plan: Plan | Waiting | None = None  # this node's current plan (reconfigure)
        self._cfg_plan: Plan | Waiting | None = None  # the plan ``server_cfg`` was made for
        # worker to worker where the workers are reached through tunnels (serve/split/peerlinks.py)
        self.links = PeerLinks(net, elected, lambda: self.plan, lambda: self.rpc.peer_port if self.rpc else None,
                               self._opener, on_listeners)  # fmt: skip

    # ---------------------------------------------------------------- our rpc-server

    async def start_rpc_server(self, model: ModelFiles, device: str | None) -> None:
        """Our rpc-server on loopback, loading weights from our own copy of the model, on ``device`` (llama.cpp's
        names, comma-separated: each is a device of its own to the host; None: its default, the CPU). A CPU host
        uses it as its last device (so the output layer runs here, on the host); workers serve it to the host."""
        assert self.bins is not None
        self.model = model
        self.device = device
        state.save_rpc_server_key(self.state_dir, "", None)  # no key from an earlier run survives
        keys = state.rpc_server_keys(self.state_dir) if self.paths.mode == "auto" else None
        shape = LinkShape.from_env()  # benchmarks: the RPC listeners pay its round trip too
        netem = (shape.rtt_ms, shape.rate_mb_s) if shape is not None and shape.rtt_ms > 0 else None
        self.rpc = RpcServer(self.bins, model.path, self.state_dir, device, keys_file=keys, tls_port=self.rpc_port,
                             vouched=model.facts.fingerprint if model.partial else None, netem=netem)  # fmt: skip
        self.rpc.start()
        try:
            await self.rpc.wait_ready()
        except ChildFailed as e:
            raise UserError(str(e)) from None

    async def release_model(self) -> None:
        """Let our model go (a ``--model auto`` node whose model was dropped): llama-server and rpc-server stop; a
        model taken up later starts its own (``start_rpc_server``)."""
        self.model = None
        if self._reconfig_task is not None:
            await asyncio.gather(self._reconfig_task, return_exceptions=True)
        self.server_cfg = None
        await self._restart_server(None, {})
        if self.rpc is not None:
            await self.rpc.stop()
            self.rpc = None

    def take_streams(self) -> None:
        """Peers' streams to our rpc-server, for its key, and API requests for our llama-server come here."""
        self.net.stream_handlers.update({STREAM_RPC: self.gate.on_stream, STREAM_RPC_KEY: self.gate.on_key_stream,
                                         STREAM_HTTP: self.door.on_stream, STREAM_PEER_OPEN: self.links.on_open,
                                         STREAM_PEER: self.links.on_peer})  # fmt: skip
        if self.sharing is not None:  # members fetching our model file
            self.net.stream_handlers[STREAM_FETCH] = self.sharing.on_stream

    # ---------------------------------------------------------------- the paths to workers

    def forget_worker(self, node: NodeId) -> None:
        """``node`` died or left: its tunnel listener, its direct endpoint and any failure of that path go with it,
        so when it comes back (its rpc-server on a new port, perhaps) the path to it is probed afresh. Its death
        was no fault of the direct path: before, a worker that came back stayed on the tunnel."""
        self.paths.forget(node)
        self.links.forget([node])
        self._probed_as.pop(node, None)
        lst = self.rpc_listeners.pop(node, None)
        if lst is not None:
            closing = asyncio.ensure_future(lst.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _server_exited(self, how: str, log_tail: str) -> None:
        """Our llama-server died: counted and said (the timeline shows it); if it could not reach a worker directly,
        that worker goes through its tunnel."""
        self.crashes += 1
        # peers stop routing here and say why until it serves again (``became_ready``); before, the record said
        # "serving" through a crash loop, and the console "loading the model: 100%"
        # back after a crash is "serves again" — once it had served: a first start that crashed is not ready yet
        self._recovering = self._recovering or self.announced
        self.announced = False
        self.net.update(state=NodeState.LOADING, why=f"llama-server {how}; restarting it"[:MAX_WHY])
        if self.say is not None:
            log = self.server.log_path if self.server else "llama-server.log"
            self.say(f"[red]llama-server {how}[/]: restarting it (its log: {log})", "died")
        broke = [w for w in serving.unreachable_workers(log_tail, self._direct_in_cfg) if w in self.paths.at]
        for worker in broke:
            self.paths.broke(worker, "llama-server could not connect")  # a dead worker: forget_worker undoes it
        if broke:
            asyncio.get_running_loop().call_soon(self.on_listeners)

    def rpc_path_of(self, worker: NodeId) -> str:
        """How our llama-server reaches ``worker`` now, for status (empty when it is not one of our workers)."""
        if self.server_cfg is None or not self.server_cfg.rpc or worker not in self.rpc_listeners:
            return ""
        facts = self._log_facts()
        ep = self._direct_in_cfg.get(worker)
        if ep is not None:
            on = ", its output straight to the next worker" if ep in facts.links else ""
            embd = ", with the token embedding" if ep == facts.embedding else ""
            return f"{serving.RpcPath.DIRECT} {ep} (TLS){embd}{on}"
        conn = self.net.peers.get(worker)
        relayed = conn is not None and not conn.is_direct
        at = f"127.0.0.1:{self.rpc_listeners[worker].port}"
        onward = at in facts.links  # over the mesh (peerlinks)
        return (f"{serving.RpcPath.TUNNEL}{' (relayed)' if relayed else ''}"
                f"{', with the token embedding' if at == facts.embedding else ''}"
                f"{', its output to the next worker through the mesh' if onward else ''}")  # fmt: skip

    def _log_facts(self) -> serving.LogFacts:
        """What our llama-server says of its workers (peer links, patch 0011; the token embedding, patch 0013): read
        from its log until it serves (the links show at its first token, the warm-up before it answers /health),
        then kept."""
        srv = self.server
        if srv is None or not srv.cfg.rpc:
            return serving.LogFacts(frozenset(), None)
        if self._facts_of is not srv:
            self._facts_of, self._facts = None, serving.log_facts(srv.log_tail())
            if srv.state == ChildState.SERVING:
                self._facts_of = srv  # read once more after it serves, never again
        return self._facts

    # ---------------------------------------------------------------- API requests for our model

    async def open_door(self, models: Callable[[], list[str]], max_tokens: int | None) -> None:
        await self.door.open(self.local_upstream, models, max_tokens, self.slot_ctx)

    def slot_ctx(self) -> int | None:
        """The context of each slot of the llama-server we run (None: we run none)."""
        return self.server_cfg.ctx_size if self.server_cfg is not None else None

    def chat_stops(self) -> tuple[str, ...]:
        """The stop strings every chat to our llama-server gets: a base model's transcript turns (llama/chat.py)."""
        ours = self.tuning.default_chat(self.model.chat if self.model else None)
        return ours.stops if ours else ()

    def local_upstream(self, model: str | None) -> Upstream | Unavailable | None:
        """Our own llama-server when it serves (the door's router: a request that came over the mesh goes no
        further)."""
        srv, facts = self.server, self.model.facts if self.model else None
        if srv is None or facts is None or srv.state != ChildState.SERVING:
            return Unavailable("this node does not serve the model now", retry_after_s=1)
        return self._ours(srv, facts.source) if model in (None, facts.source) else None

    def _ours(self, srv: LocalServer, name: str) -> Upstream:
        """Our own llama-server as the API's upstream for ``name``: its key, our slots, its chat stops and kind."""
        return Upstream(name, srv.base_url, srv.key, self.slots, stops=self.chat_stops(),
                        embedding=self.model is not None and self.model.embedding)  # fmt: skip

    def upstream(
        self, model: str | None, served: list[str], facts: ModelFacts | None, remote: tuple[NodeId, str] | None,
        plan: Plan | Waiting | None, host: NodeId | None, me: NodeId, host_says: str = "", here: bool = True,
    ) -> Upstream | Unavailable | None:  # fmt: skip
        """Where the API sends a request for ``model`` (see ``serving.route``): our llama-server, a tunnel listener
        to the serving host (opened in the background on first need), or a 503 with the reason. ``here``: False when
        the request goes to ``remote`` although our own llama-server serves the model too (a replica less busy)."""
        srv = self.server
        local = None
        if srv is not None and facts is not None and here:
            p = srv.load_progress() if srv.state == ChildState.LOADING and not srv.reason else -1
            local = serving.LocalServing(facts.source, srv.state, srv.reason or (f"loading the model: {p}%" if p >= 0
                                                                                 else ""))  # fmt: skip
        listeners = self.door.listeners
        ready = remote is not None and remote[0] in listeners
        r = serving.route(model, served, local, remote, ready, plan, host, me, host_says)
        if isinstance(r, serving.Local):
            assert srv is not None
            return self._ours(srv, r.model)
        if isinstance(r, serving.Remote):
            return Upstream(r.model, f"http://127.0.0.1:{listeners[r.host].port}")
        if isinstance(r, serving.Connecting):
            self.door.open_listener(r.host)
            return Unavailable("connecting to the host", retry_after_s=r.retry_after_s)
        if isinstance(r, serving.Busy):
            return Unavailable(r.reason, retry_after_s=r.retry_after_s)
        return None

    def _opener(self, node: NodeId, kind: int) -> Callable[[], Stream | None]:
        def open_stream() -> Stream | None:
            conn = self.net.peers.get(node)
            if conn is None or conn.closed.is_set():
                return None
            try:
                return conn.open_stream(kind)
            except ConnectionError:
                return None  # closing: the tunnel's client is closed at once, like a peer that is gone

        return open_stream

    # ---------------------------------------------------------------- llama-server

    def reconfigure(self, plan: Plan | Waiting | None, me: NodeId) -> None:
        """Run llama-server as the plan says, restarting it only when its configuration changes."""
        self.plan = plan
        can_host = self.bins is not None and self.model is not None
        for n, inc in list(self._probed_as.items()):  # a worker restarted (quicker than a death is declared)
            rec = self.net.record(n)
            if rec is not None and rec.incarnation != inc:
                self.forget_worker(n)
        w = serving.wanted_server(
            plan, me, can_host, frozenset(self.rpc_listeners), frozenset(self.net.peers), self.device is not None,
            self._still_fetching(plan) if isinstance(plan, Plan) and plan.host == me else frozenset(),
            self._host_wait.step(serving.not_electing(plan, me, self._host_of), time.monotonic())[0],
        )
        if isinstance(w, serving.NeedLayers | serving.NeedElected):
            return  # the next change (their record naming the layers held, or us) reconfigures
        if isinstance(w, serving.NeedTunnels):
            if w.missing and (self._rpc_listener_task is None or self._rpc_listener_task.done()):
                self._rpc_listener_task = asyncio.ensure_future(self._make_rpc_listeners(list(w.missing)))
            return  # on_listeners (or the next change) reconfigures
        want: ServerConfig | None = None
        direct: dict[NodeId, str] = {}  # workers reached directly (not through their tunnel)
        peers: tuple[str, ...] = ()
        if w is not None:
            assert self.model is not None
            rpc: tuple[str, ...] = ()
            extra: tuple[str, ...] = ()
            if isinstance(w, serving.Split):
                # workers first (the first layers), our own device last: the output layer stays here — through
                # our rpc-server on a CPU host, in-process on a GPU host (llama.cpp lists RPC devices first)
                rpc = tuple(self.paths.at.get(n) or f"127.0.0.1:{self.rpc_listeners[n].port}" for n in w.workers)
                direct = {n: self.paths.at[n] for n in w.workers if n in self.paths.at}
                peers = serving.peer_listeners(w.workers, direct, self.paths.peer_at)
                if not direct and len(w.workers) > 1:  # every worker through its tunnel: links through the mesh
                    ports = self.links.ports_for(w.workers)
                    if ports is None:
                        return  # the workers are asked for their forwarders; on_listeners reconfigures
                    peers = serving.tunnel_peer_entries(w.workers, dict(zip(w.workers, rpc, strict=True)), ports)
                if w.own_rpc:
                    assert self.rpc is not None
                    rpc += (f"127.0.0.1:{self.rpc.port}",)
                extra = ("--load-mode", "none", "--fit", "off")
            if isinstance(plan, Plan):  # what the plan keeps in RAM: ours, the workers' (after --rpc)
                workers = w.workers if isinstance(w, serving.Split) else ()
                extra += serving.ram_flags(plan, me, dict(zip(workers, rpc, strict=False)))
            want = ServerConfig(
                model=self.model.path, alias=self.model.facts.source, ctx_size=self.sizing.ctx,
                parallel=self.sizing.parallel, tuning=self.tuning, chat=self.model.chat,
                threads=default_threads(), rpc=rpc, tensor_split=w.tensor_split if isinstance(w, serving.Split) else (),
                extra=extra, draft=self.model.draft, draft_max=self.draft_max,
                draft_device=first_device(self.device),
                tls_keys=state.rpc_client_keys(self.state_dir) if direct else None, peers=peers,
                embd_first=isinstance(w, serving.Split) and w.embd_first,
                n_gpu_layers=plan.n_gpu_layers if isinstance(plan, Plan) else None,
                embeddings=self.model.embedding,
            )  # fmt: skip
        self._cfg_plan = plan
        if want != self.server_cfg:
            self.replace_server(want, direct)

    def serves_plan(self) -> bool:
        """Our llama-server serves the plan this node has now: False while a new plan waits (for tunnels, layers,
        keys) and while the llama-server it needs loads; the one it replaces may still answer meanwhile."""
        srv, plan = self.server, self.plan
        return plan is not None and self._cfg_plan == plan and srv is not None and srv.state == ChildState.SERVING

    def replace_server(self, want: ServerConfig | None, direct: dict[NodeId, str]) -> None:
        """Our llama-server is to run ``want`` (None: none): the one running now gets no request from this moment
        (status shows the new plan and nobody serving it yet, in the same tick), and the restart waits for any
        still under way, so that two plans in quick succession leave one llama-server, not one each."""
        self.server_cfg = want
        retired, self.server = self.server, None
        self._reconfig_task = asyncio.ensure_future(self._restart_server(want, direct, retired, self._reconfig_task))

    def _host_of(self, n: NodeId) -> NodeId | None:
        rec = self.net.record(n)
        return rec.host if rec is not None else None

    def _still_fetching(self, plan: Plan | Waiting | None) -> frozenset[NodeId]:
        """The workers of ``plan`` still fetching their layers, that the split waits for (LAYER_WAIT_S at most:
        then their weights come from us over the network, the stock way)."""
        def held(n: NodeId) -> tuple[tuple[int, int], ...] | None:
            rec = self.net.record(n)
            return rec.held if rec is not None else None

        wait, began, stopped = self._layer_wait.step(serving.lacking_layers(plan, held), time.monotonic())
        for n in began:
            self._say(f"the split waits for {crypto.short(n)} to fetch its layers from the mesh", "plan")
        for n in stopped:
            self._say(f"[yellow]{crypto.short(n)} has not fetched its layers in {LAYER_WAIT_S:.0f} s: loading the "
                      "split without waiting (its missing weights go over the network)[/]", "plan")  # fmt: skip
        return wait

    def _say(self, line: str, kind: str) -> None:
        if self.say is not None:
            self.say(line, kind)

    async def _make_rpc_listeners(self, nodes: list[NodeId]) -> None:
        for n in nodes:
            if n not in self.rpc_listeners:
                stats = self.rpc_stats.setdefault(n, TunnelStats())
                wire = self.rpc_wire.setdefault(n, WireStats())
                stats.watcher = lambda wire=wire: CommandParser(wire).feed
                lst = TunnelListener(self._opener(n, STREAM_RPC), stats)
                await lst.start()
                rec = self.net.record(n)
                self._probed_as[n] = rec.incarnation if rec is not None else 0
                await self.paths.probe(n)  # the tunnel stays ready as the fallback
                self.rpc_listeners[n] = lst  # only once it has a port
        self.on_listeners()

    async def _restart_server(self, cfg: ServerConfig | None, direct: dict[NodeId, str],
                              retired: LocalServer | None = None, before: asyncio.Future[None] | None = None) -> None:
        if before is not None:  # the restart before this one may still start a server: this one stops it
            await asyncio.gather(before, return_exceptions=True)
        stale = [s for s in (retired, self.server) if s is not None]
        self.server = None
        for old in stale:
            # llama-server answers SIGTERM only once its streams end (10 s of a long answer held a worker's
            # rpc-server that the new plan's host waited for): the streams cut here go on where they came from
            await old.stop(grace_s=RESTART_GRACE_S)
        if cfg is not None and cfg is not self.server_cfg:
            return  # a later plan came: its restart, chained after this one, starts the server
        self.announced, self._recovering = False, False
        self._direct_in_cfg = {}
        if cfg is None or self.bins is None:
            mine = self.net.core.record if self.net.core else None  # we serve nothing now (a plan waiting for peers)
            if mine is not None and mine.state in (NodeState.LOADING, NodeState.SERVING):
                self.net.update(state=NodeState.READY)  # peers stop routing here
            return
        self.net.update(state=NodeState.LOADING)  # peers stop routing here until we announce "serving" again
        if direct:  # fresh keys for this llama-server: each worker's earlier key stops working
            rows = []
            for worker, ep in direct.items():
                key = await self.paths.ask_key(worker)
                if not isinstance(key, serving.RpcKey):
                    self.paths.broke(worker, "no key from the worker")
                    self.server_cfg = None
                    self.on_listeners()  # reconfigures without it
                    return
                rows.append((ep, key.identity, key.key))
            state.save_rpc_client_keys(self.state_dir, rows)
            self._direct_in_cfg = dict(direct)
        self.slots.resize(cfg.parallel)
        self.server = LocalServer(self.bins, cfg, self.state_dir)
        self.server.on_exit = self._server_exited
        self.server.start()
        self.generations += 1

    def slots_now(self) -> tuple[int, int, int, int]:
        """Our llama-server's slots: busy, in all, requests waiting for one, and each one's context (tokens)."""
        busy, total, waiting = self.slots.snapshot()
        return busy, total, waiting, self.server_cfg.ctx_size if self.server_cfg else 0

    def became_ready(self) -> bool:
        """True once, when our llama-server has started serving: peers then route here (gossip state)."""
        if self.announced or self.server is None or self.server.state != ChildState.SERVING:
            return False
        self.announced = True
        self.net.update(state=NodeState.SERVING, why="")
        if self._recovering:  # the same configuration, back after a crash: said once, not "ready" all over again
            self._recovering = False
            if self.say is not None:
                self.say("[green]llama-server serves again[/]", "ready")
            return False
        # what loading the model cost on each worker's wire (later traffic is per-token inputs)
        self.at_load = {n: _weights_and_trips(w) for n, w in self.rpc_wire.items()}
        return True

    # ---------------------------------------------------------------- counts and shutdown

    def tunnel_counts(self, node: NodeId) -> dict[str, int]:
        rpc = self.rpc_stats.get(node, TunnelStats())
        http = self.door.stats.get(node, TunnelStats())
        # bytes_up: what we sent to that peer through tunnels; bytes_down: what came back from it
        out = {"rpc_sent": rpc.bytes_up, "rpc_received": rpc.bytes_down, "rpc_tunnels": rpc.tunnels,
               "http_sent": http.bytes_up, "http_received": http.bytes_down}  # fmt: skip
        if (wire := self.rpc_wire.get(node)) is not None:
            out["rpc_local_loads"] = wire.commands[Cmd.SET_TENSOR_GGUF]
            if node in self.at_load:
                out["load_weight_bytes"], out["load_round_trips"], out["load_allocated"] = self.at_load[node]
        return out

    async def stop(self) -> None:
        self.server_cfg = None  # a restart under way stops what it retires and starts nothing
        if self._reconfig_task is not None:
            await asyncio.gather(self._reconfig_task, return_exceptions=True)
        await self.door.stop()
        if self.sharing is not None and self.sharing.direct is not None:
            await self.sharing.direct.stop()
        if self.server:
            await self.server.stop()
        if self.rpc:
            await self.rpc.stop()
        for lst in self.rpc_listeners.values():
            await lst.close()
        await self.links.close()


def _weights_and_trips(w: WireStats) -> tuple[int, int, int]:
    return w.payload[Cmd.SET_TENSOR] + w.payload[Cmd.SET_TENSOR_HASH], w.round_trips, w.allocated
