"""The one place that wires a node together: state, model facts, the mesh, election and plan, output.

(Serving — llama.cpp processes, tunnels, the API on :9337 — plugs in here: see the [serve] issue.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console

from meshllm import __version__
from meshllm.errors import MeshError, UserError
from meshllm.llama.build import Binaries
from meshllm.llama.gguf import model_fingerprint, model_shape, read_header
from meshllm.llama.processes import ChildFailed, port_in_use
from meshllm.llama.rpcwire import Cmd, WireStats
from meshllm.llama.supervisor import LocalServer, RpcServer, ServerConfig, default_threads
from meshllm.models.download import resolve
from meshllm.net.endpoint import STREAM_HTTP, STREAM_RPC, Conn, Stream
from meshllm.net.meshnet import MeshNet, new_mesh
from meshllm.net.tunnel import TunnelListener, TunnelStats, connect_and_bridge
from meshllm.paths import models_dir
from meshllm.paths import state_dir as default_state_dir
from meshllm.proto import crypto, serving
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.debounce import Debouncer
from meshllm.proto.gossip import ModelFacts, PeerRecord
from meshllm.proto.planner import GB, ModelShape, Plan, Slot, Waiting, plan, plan_broken
from meshllm.serve.api import Api, Unavailable, Upstream
from meshllm.state import load_membership, load_or_create_key, save_membership, save_token, write_private

log = logging.getLogger("meshllm.node")
PLAN_DEBOUNCE_S = 2.0
STATUS_FILE = "status.json"


@dataclass
class NodeOptions:
    model: Path | None = None
    client: bool = False
    join: list[str] = field(default_factory=list)
    state_dir: Path | None = None
    bind_host: str = "0.0.0.0"
    bind_port: int = 0
    advertise: list[str] = field(default_factory=list)
    relay: str | None = None  # --relay HOST:PORT
    relay_mode: str = "auto"  # auto | on (--relay-server) | off (--no-relay-server)
    token_ttl_s: float = 86400.0
    max_vram_gb: float | None = None
    ctx_size: int = 4096
    tensor_split: list[float] | None = None
    port: int = 9337
    listen_all: bool = False
    api_key: str | None = None
    bins: Binaries | None = None  # None: a lite client
    console_port: int | None = None  # --console [PORT]
    draft: str | None = None  # --draft PATH|NAME
    draft_max: int = 8
    no_draft: bool = False
    auto_model: bool = False  # joined without --model: serve the mesh's model if we have a copy
    models_dir: Path | None = None


def measure_capacity(max_gb: float | None) -> tuple[int, str]:
    """A stable figure for what this node can hold, measured once at start: usable RAM on a CPU node
    (three quarters of it; the rest is for the system). ``--max-vram`` caps it."""
    cap = int(psutil.virtual_memory().total * 0.75)
    device = "cpu"
    if max_gb is not None:
        cap = min(cap, int(max_gb * GB))
    return cap, device


def parse_tokens(texts: list[str], now: float, mesh_id: bytes | None) -> list[tok.Token]:
    """Every --join token checked before anything starts: one clear TokenError otherwise."""
    out = []
    for t in texts:
        out.append(tok.check(tok.parse(t), now, mesh_id))
    return out


class Node:
    def __init__(self, opts: NodeOptions, console: Console) -> None:
        self.o = opts
        self.console = console
        self.state = default_state_dir(opts.state_dir)
        self.shape: ModelShape | None = None
        self.facts: ModelFacts | None = None
        self.net: MeshNet | None = None
        self.host: NodeId | None = None
        self.plan: Plan | Waiting | None = None
        self._last_status = ""
        self._stop = asyncio.Event()
        self.server: LocalServer | None = None
        self._server_cfg: ServerConfig | None = None
        self._announced = False
        self.api: Api | None = None
        self.model_path: Path | None = None
        self.draft_path: Path | None = None
        self._reconfig_task: asyncio.Future[None] | None = None
        self._at_load: dict[NodeId, tuple[int, int, int]] = {}
        self._elections = 0
        self._server_generations = 0  # llama-server configurations started (a re-plan that changes it: +1)
        # joins come in bursts and a new plan costs a model load: adopt one once it has held for a moment
        self._plan_debounce = Debouncer[Plan | Waiting](PLAN_DEBOUNCE_S, first_at_once=True)
        self._listener_task: asyncio.Future[TunnelListener] | None = None
        self._rpc_listener_task: asyncio.Future[None] | None = None
        self.rpc: RpcServer | None = None  # our own rpc-server (worker, and the host's last device)
        self.rpc_stats: dict[NodeId, TunnelStats] = {}  # per peer
        self.http_stats: dict[NodeId, TunnelStats] = {}
        self._rpc_listeners: dict[NodeId, TunnelListener] = {}  # host side: one per worker
        self._http_listeners: dict[NodeId, TunnelListener] = {}  # any node: one per remote host
        self._rpc_tunnels: dict[NodeId, set[asyncio.Task[None]]] = {}  # worker side: per dialling host

    # ---------------------------------------------------------------- setup (before anything listens)

    def prepare(self) -> list[tok.Token]:
        now = time.time()
        api_host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        if port_in_use(self.o.port, api_host):
            raise UserError(f"port {self.o.port} is in use: stop what runs there or pass --port N")
        m = load_membership(self.state)
        tokens = parse_tokens(self.o.join, now, m.mesh_id if m else None)  # before anything is written
        if self.o.model is not None:
            path = resolve(str(self.o.model), self.o.models_dir)
            if not path.is_file():
                raise UserError(f"--model {path}: no such file")
            hdr = read_header(path)
            self.model_path = path
            self.shape = model_shape(hdr)
            named = path != self.o.model and "/" not in str(self.o.model)  # by name: served under that name
            self.draft_path = self._choose_draft(path, hdr)
            self.facts = ModelFacts(
                fingerprint=model_fingerprint(path), size=path.stat().st_size,
                n_layer=self.shape.n_layer, source=str(self.o.model) if named else path.stem,
            )  # fmt: skip
        self.key = load_or_create_key(self.state)
        self.me = crypto.node_id(self.key)
        if m is None and not tokens:
            m = new_mesh(self.key, now)
            self.console.print(f"new mesh [bold]{m.mesh_id.hex()[:8]}[/] founded by this node")
        if m is not None:
            m.incarnation += 1  # a new life: outranks our old records and tombstones
            save_membership(self.state, m)
        self.net = MeshNet(
            self.key, m, self.state, bind=(self.o.bind_host, self.o.bind_port),
            advertise=self.o.advertise or None, on_event=self._on_event, relay=self.o.relay_mode,
            relay_hint=self.o.relay,
        )  # fmt: skip
        self.net.on_change = self._on_change
        self.net.on_addrs = self._on_addrs
        self.net.on_connect = self._on_connect
        return tokens

    def _choose_draft(self, model: Path, hdr: object) -> Path | None:
        """--draft, or the catalog's paired draft when it is installed; refused if the vocabularies differ."""
        from meshllm.llama.gguf import GGUFHeader, vocab_signature
        from meshllm.models import catalog
        from meshllm.models.download import installed, resolve

        assert isinstance(hdr, GGUFHeader)
        if self.o.no_draft:
            return None
        if self.o.draft:
            draft = resolve(self.o.draft, self.o.models_dir)
        else:
            entry = catalog.find(str(self.o.model)) if self.o.model else None
            d = catalog.find(entry.draft) if entry and entry.draft else None
            found = installed(d.files[0], models_dir(self.o.models_dir)) if d else None
            if found is None:
                return None
            draft = found
            self.console.print(f"draft model: {d.name if d else draft.name} (paired in the catalog; --no-draft)")
        if vocab_signature(read_header(draft)) != vocab_signature(hdr):
            raise UserError(f"--draft {draft.name}: its vocabulary differs from {model.name}'s; drafts must share it")
        return draft

    # ---------------------------------------------------------------- run

    async def run(self) -> int:
        tokens = self.prepare()
        assert self.net is not None
        await self._start_api()
        self.net.stream_handlers[STREAM_RPC] = self._on_rpc_stream
        self.net.stream_handlers[STREAM_HTTP] = self._on_http_stream
        if self.o.bins is not None and self.model_path is not None:
            await self._start_rpc_server()
        addrs = await self.net.start()
        cap, device = measure_capacity(self.o.max_vram_gb)
        self.capacity = cap
        lite = self.o.client or self.facts is None
        self.net.update(
            role="client" if lite else "worker", capacity=0 if lite else cap, device=device,
            model=self.facts, state="ready", version=__version__,
        )  # fmt: skip
        write_private(self.state / "node.json", json.dumps({"addrs": addrs}).encode())
        self.console.print(
            f"node [bold]{crypto.short(self.me)}[/] listening on UDP {', '.join(addrs)}"
            + (f" — capacity {cap / GB:.1f} GB ({device})" if not self.o.client else " — lite client")
        )
        if tokens:
            await self._join(tokens)
        self._print_token()
        if self.o.console_port is not None:
            await self._start_console(self.o.console_port)
        if self.o.auto_model:
            await self._adopt_model()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self._stop.wait()
        self.console.print("leaving the mesh")
        await self.net.stop(leave=True)
        if self.server:
            await self.server.stop()
        if self.rpc:
            await self.rpc.stop()
        for lst in [*self._rpc_listeners.values(), *self._http_listeners.values()]:
            await lst.close()
        if self.api:
            await self.api.stop()
        if getattr(self, "web_console", None) is not None:
            await self.web_console.stop()
        return 0

    # ---------------------------------------------------------------- tunnels

    async def _start_rpc_server(self) -> None:
        """Our rpc-server on loopback, loading weights from our own copy of the model. The host uses it as
        its last device (so the output layer runs here, on the host); workers serve it to the host."""
        assert self.o.bins is not None and self.model_path is not None
        self.rpc = RpcServer(self.o.bins, self.model_path, self.state)
        self.rpc.start()
        try:
            await self.rpc.wait_ready()
        except ChildFailed as e:
            raise UserError(str(e)) from None

    async def _on_rpc_stream(self, conn: Conn, st: Stream) -> None:
        """Worker side: only the elected host may reach our rpc-server (anyone reaching it owns the machine)."""
        peer = conn.peer
        rec = self._record(peer) if peer else None
        hosts = rec.model.fingerprint if rec is not None and rec.role == "host" and rec.model is not None else None
        up = self.rpc is not None and self.rpc.alive()
        if peer is None or not serving.may_open_rpc(
            peer, self.host, hosts, self.facts.fingerprint if self.facts else None, up
        ):
            log.warning("refused an RPC tunnel from %s: not the elected host", crypto.short(peer) if peer else "?")
            st.reset()
            return
        # rpc-server serves one client at a time: tunnels from a former host must not hold it
        for old, tasks in self._rpc_tunnels.items():
            if old != peer:
                for t in tasks:
                    t.cancel()
        task = asyncio.current_task()
        mine = self._rpc_tunnels.setdefault(peer, set())
        if task is not None:
            mine.add(task)
        try:
            assert self.rpc is not None
            await connect_and_bridge(st, self.rpc.port, self.rpc_stats.setdefault(peer, TunnelStats()))
        finally:
            if task is not None:
                mine.discard(task)

    def _drop_stale_tunnels(self) -> None:
        """rpc-server serves one client at a time: when the host changes, close every tunnel from another node
        at once, so the new host's load never waits on a dead connection."""
        for peer, tasks in self._rpc_tunnels.items():
            if peer != self.host:
                for t in list(tasks):
                    t.cancel()

    async def _on_http_stream(self, conn: Conn, st: Stream) -> None:
        """Host side: a peer's API forwards a request for our model to our llama-server."""
        if self.server is None or self.server.state != "serving" or conn.peer is None:
            st.reset()
            return
        await connect_and_bridge(st, self.server.port, self.http_stats.setdefault(conn.peer, TunnelStats()))

    def _opener(self, node: NodeId, kind: int) -> Callable[[], Stream | None]:
        def open_stream() -> Stream | None:
            assert self.net is not None
            conn = self.net.peers.get(node)
            if conn is None or conn.closed.is_set():
                return None
            return conn.open_stream(kind)

        return open_stream

    async def _http_listener(self, host: NodeId) -> TunnelListener:
        lst = self._http_listeners.get(host)
        if lst is None:
            lst = TunnelListener(self._opener(host, STREAM_HTTP), self.http_stats.setdefault(host, TunnelStats()))
            await lst.start()
            self._http_listeners[host] = lst  # only once it has a port
        return lst

    # ---------------------------------------------------------------- the API on :9337

    async def _start_api(self) -> None:
        host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        if port_in_use(self.o.port, host):
            raise UserError(f"port {self.o.port} is in use: stop what runs there or pass --port N")
        self.api = Api(self._route, self._models, lambda: self.status(time.time()), api_key=self.o.api_key,
                       metrics=self.metrics_text)  # fmt: skip
        try:
            await self.api.start(host, self.o.port)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{self.o.port}: {e.strerror}") from None

    def _models(self) -> list[str]:
        net = self.net
        if net is None or net.core is None:
            return []
        return sorted({r.model.source for r in net.core.alive(time.time()) if r.model})

    def _route(self, model: str | None) -> Upstream | Unavailable | None:
        srv = self.server
        local = None
        if srv is not None and self.facts is not None:
            local = serving.LocalServing(self.facts.source, srv.state, srv.reason)
        remote = self._serving_host(model)
        r = serving.route(
            model, self._models(), local, (remote, self._model_of(remote)) if remote else None,
            remote in self._http_listeners, self.plan, self.host, self.me,
        )  # fmt: skip
        if isinstance(r, serving.Local):
            assert srv is not None
            return Upstream(r.model, srv.base_url)
        if isinstance(r, serving.Remote):
            return Upstream(r.model, f"http://127.0.0.1:{self._http_listeners[r.host].port}")
        if isinstance(r, serving.Connecting):
            self._spawn_listener(r.host)
            return Unavailable("connecting to the host", retry_after_s=r.retry_after_s)
        if isinstance(r, serving.Busy):
            return Unavailable(r.reason, retry_after_s=r.retry_after_s)
        return None

    def _serving_host(self, model: str | None) -> NodeId | None:
        net = self.net
        return net.core.serving_host(model, time.time()) if net is not None and net.core is not None else None

    def _model_of(self, node: NodeId) -> str:
        r = self._record(node)
        return r.model.source if r and r.model else "?"

    def _spawn_listener(self, host: NodeId) -> None:
        if self._listener_task is None or self._listener_task.done():
            self._listener_task = asyncio.ensure_future(self._http_listener(host))

    # ---------------------------------------------------------------- hosting

    def _reconfigure(self) -> None:
        """Run llama-server as the plan says, restarting it only when its configuration changes."""
        assert self.net is not None
        can_host = self.o.bins is not None and self.model_path is not None and self.facts is not None
        w = serving.wanted_server(
            self.plan, self.me, can_host, frozenset(self._rpc_listeners), frozenset(self.net.peers)
        )
        if isinstance(w, serving.NeedTunnels):
            if w.missing and (self._rpc_listener_task is None or self._rpc_listener_task.done()):
                self._rpc_listener_task = asyncio.ensure_future(self._make_rpc_listeners(list(w.missing)))
            return  # the next change reconfigures
        want: ServerConfig | None = None
        if w is not None:
            assert self.model_path is not None and self.facts is not None
            rpc: tuple[str, ...] = ()
            extra: tuple[str, ...] = ()
            if isinstance(w, serving.Split):
                assert self.rpc is not None
                rpc = (*(f"127.0.0.1:{self._rpc_listeners[n].port}" for n in w.workers), f"127.0.0.1:{self.rpc.port}")
                extra = ("--load-mode", "none", "--fit", "off")
            want = ServerConfig(
                model=self.model_path, alias=self.facts.source, ctx_size=self.o.ctx_size, threads=default_threads(),
                rpc=rpc, tensor_split=w.tensor_split if isinstance(w, serving.Split) else (), extra=extra,
                draft=self.draft_path, draft_max=self.o.draft_max,
            )  # fmt: skip
        if want == self._server_cfg:
            return
        self._server_cfg = want
        self._reconfig_task = asyncio.ensure_future(self._restart_server(want))

    async def _make_rpc_listeners(self, nodes: list[NodeId]) -> None:
        for n in nodes:
            if n not in self._rpc_listeners:
                stats = self.rpc_stats.setdefault(n, TunnelStats())
                stats.rpc = stats.rpc or WireStats()
                lst = TunnelListener(self._opener(n, STREAM_RPC), stats)
                await lst.start()
                self._rpc_listeners[n] = lst  # only once it has a port
        self._on_change()

    async def _restart_server(self, cfg: ServerConfig | None) -> None:
        old, self.server = self.server, None
        if old:
            await old.stop()
        self._announced = False
        if cfg is None or self.o.bins is None:
            return
        if self.net is not None:
            self.net.update(state="loading")  # peers stop routing here until we announce "serving" again
        self.server = LocalServer(self.o.bins, cfg, self.state)
        self.server.start()
        self._server_generations += 1

    def _announce(self) -> None:
        if self._announced or self.server is None or self.server.state != "serving" or self.net is None:
            return
        self._announced = True
        self.net.update(state="serving")
        # what loading the model cost on each worker's wire (later traffic is per-token inputs)
        self._at_load = {n: _weights_and_trips(st) for n, st in self.rpc_stats.items() if st.rpc is not None}
        host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        model = self.facts.source if self.facts else "?"
        draft = f", draft {self.draft_path.name}" if self.draft_path else ""
        self.console.print(f"[bold green]ready:[/] http://{host}:{self.o.port}/v1 — model {model}{draft}")
        for line in agent_lines(model, self.o.port):
            self.console.print(line, markup=False)

    async def _join(self, tokens: list[tok.Token]) -> None:
        assert self.net is not None
        errors = []
        for t in tokens:
            try:
                await self.net.join(t)
                self.console.print(f"joined mesh [bold]{t.mesh_id.hex()[:8]}[/] via {crypto.short(t.issuer)}")
                return
            except (MeshError, TimeoutError, OSError) as e:
                errors.append(f"{crypto.short(t.issuer)}: {e}")
        raise UserError("could not join: " + "; ".join(errors))

    async def _start_console(self, port: int) -> None:
        from meshllm.serve.console import Console as WebConsole

        def token() -> str | None:
            path = self.state / "token"
            return path.read_text().strip() if path.exists() else None

        self.web_console = WebConsole(lambda: self.status(time.time()), token, f"http://127.0.0.1:{self.o.port}/v1",
                                      self.o.api_key)  # fmt: skip
        try:
            await self.web_console.start(port)
        except OSError as e:
            raise UserError(f"--console: cannot listen on 127.0.0.1:{port}: {e.strerror}") from None
        self.console.print(f"console: http://127.0.0.1:{port}/")

    def metrics_text(self) -> str:
        from meshllm.serve.metrics import Exposition

        x = Exposition()
        c = self.api.counters if self.api else None
        if c is not None:
            x.metric("mesh_llm_tokens_generated_total", "counter", "tokens generated through this node's API",
                     c.tokens_generated)  # fmt: skip
            x.metric("mesh_llm_tokens_per_second", "gauge", "decode speed of the last completion",
                     c.last_tokens_per_second)  # fmt: skip
        for code, n in sorted((self.api.requests if self.api else {}).items()):
            x.metric("mesh_llm_requests_total", "counter", "API requests by status", n, {"status": str(code)})
        x.metric("mesh_llm_elections_total", "counter", "host changes seen", self._elections)
        x.metric("mesh_llm_child_restarts_total", "counter", "llama-server restarts after a crash",
                 self.server.restarts if self.server else 0)  # fmt: skip
        net = self.net
        if net is not None and net.core is not None:
            for r in net.core.alive(time.time()):
                if r.node == self.me:
                    continue
                peer = {"peer": crypto.short(r.node)}
                conn = net.peers.get(r.node)
                x.metric("mesh_llm_peer_direct", "gauge", "1 when connected directly, 0 through gossip only",
                         1 if conn else 0, peer)  # fmt: skip
                rtt = net.core.rtt_ms.get(r.node)
                if rtt is not None:
                    x.metric("mesh_llm_peer_rtt_ms", "gauge", "round-trip time to the peer", rtt, peer)
                t = self._tunnel_counts(r.node)
                for kind in ("rpc", "http"):
                    x.metric("mesh_llm_tunnel_bytes_sent_total", "counter", "tunnel bytes sent to the peer",
                             t[f"{kind}_sent"], {**peer, "kind": kind})  # fmt: skip
                    x.metric("mesh_llm_tunnel_bytes_received_total", "counter", "tunnel bytes received from the peer",
                             t[f"{kind}_received"], {**peer, "kind": kind})  # fmt: skip
        return x.text()

    async def _adopt_model(self) -> None:
        """Joined without --model: find the mesh's model on this machine by fingerprint (any file name) and
        serve it as a worker; otherwise stay a lite client and say why."""
        assert self.net is not None
        facts: ModelFacts | None = None
        for _ in range(40):
            facts = self._mesh_model()
            if facts is not None:
                break
            await asyncio.sleep(0.25)
        if facts is None:
            self.console.print("[yellow]the mesh serves no model yet: staying a lite client[/]")
            return
        where = models_dir(self.o.models_dir)
        found = await asyncio.to_thread(find_by_fingerprint, where, facts.fingerprint, facts.size)
        if found is None:
            self.console.print(
                f"[yellow]no copy of {facts.source} ({facts.size / GB:.2f} GB, fingerprint "
                f"{facts.fingerprint[:12]}) in {where}: staying a lite client (downloading it is the [models] "
                f"issue's work)[/]"
            )
            return
        if self.o.bins is None:
            self.console.print("[yellow]found the model but no llama.cpp binaries: staying a lite client[/]")
            return
        self.console.print(f"found the mesh's model {facts.source} as {found} (same fingerprint): joining as a worker")
        self.model_path = found
        self.shape = model_shape(read_header(found))
        self.facts = facts
        await self._start_rpc_server()
        self.net.update(role="worker", capacity=self.capacity, model=facts)

    def _mesh_model(self) -> ModelFacts | None:
        net = self.net
        if net is None or net.core is None:
            return None
        recs = [r for r in net.core.table.alive(time.time()) if r.model is not None and r.role != "client"]
        recs.sort(key=lambda r: (r.role != "host", r.node))
        return recs[0].model if recs else None

    def _print_token(self) -> None:
        assert self.net is not None
        t = self.net.mint_token(self.o.token_ttl_s)
        path = save_token(self.state, t.encode())
        if sys.stdout.isatty():
            self.console.print(f"invite token (valid {self.o.token_ttl_s / 3600:.0f} h, also in {path}):")
            print(t.encode(), flush=True)
        else:  # stdout is a file or a pipe, perhaps a log: keep the secret out of it
            self.console.print(f"invite token written to {path} (mode 0600); `mesh-llm token` prints a new one")

    # ---------------------------------------------------------------- mesh events

    def _name(self, node: NodeId) -> str:
        return crypto.short(node) + (" (me)" if node == self.me else "")

    def _record(self, node: NodeId) -> PeerRecord | None:
        assert self.net is not None and self.net.core is not None
        if node == self.me:
            return self.net.core.record
        e = self.net.core.table.entries.get(node)
        return e.record if e else None

    def _on_event(self, kind: str, node: NodeId, detail: str) -> None:
        assert self.net is not None and self.net.core is not None
        if kind == "joined":
            r = self._record(node)
            conn = self.net.peers.get(node)
            path = conn.path if conn else "not connected yet"
            rtt = self.net.core.rtt_ms.get(node)
            role = r.role if r else "?"
            cap = f"{r.capacity / GB:.1f} GB" if r and r.capacity else "no capacity"
            self.console.print(f"[green]+[/] peer {self._name(node)} joined: {role}, {cap}, {path}"
                               + (f", RTT {rtt:.1f} ms" if rtt is not None else ""))  # fmt: skip
        elif kind in ("left", "died"):
            how = "left" if kind == "left" else "went silent and is declared dead"
            self.console.print(f"[red]-[/] peer {self._name(node)} {how}")
        elif kind == "host":
            self._elections += 1
            self.console.print(f"[bold]host elected:[/] {self._name(node)}")
        elif kind == "refuted":
            self.console.print(f"[yellow]was declared dead by a peer; back as {detail}[/]")

    def _on_connect(self, node: NodeId, path: str) -> None:
        self.console.print(f"[cyan]~[/] connected to {self._name(node)}: {path}")

    def _on_addrs(self, addrs: list[str]) -> None:
        """Members told us our public address: later tokens carry it."""
        write_private(self.state / "node.json", json.dumps({"addrs": addrs}).encode())
        self.console.print(f"addresses as members see them: {', '.join(addrs[:3])}")
        if self.net is not None and self.net.m is not None and (self.state / "token").exists():
            save_token(self.state, self.net.mint_token(self.o.token_ttl_s).encode())

    def _on_change(self) -> None:
        net = self.net
        if net is None or net.core is None:
            return
        now = time.time()
        host = net.core.elected_host(now)
        net.flush_events()
        if host != self.host:
            self.host = host
            self._drop_stale_tunnels()
            if not self.o.client and self.facts is not None:
                net.update(role="host" if host == self.me else "worker")
        self._replan(now)
        self._reconfigure()
        self._announce()
        remote = self._serving_host(None)
        if remote is not None and remote not in self._http_listeners:
            self._spawn_listener(remote)  # ready before the first request
        self._write_status(now)

    def _replan(self, now: float) -> None:
        assert self.net is not None and self.net.core is not None
        if self.host is None or self.shape is None or self.facts is None:
            return
        recs = [r for r in self.net.core.alive(now) if r.model and r.model.fingerprint == self.facts.fingerprint
                and r.role != "client"]  # fmt: skip
        host_rec = next((r for r in recs if r.node == self.host), None)
        if host_rec is None:
            return
        host_rtt = host_rec.rtt_ms
        others = [
            Slot(r.node, r.capacity, host_rtt.get(crypto.short(r.node), 0.0)) for r in recs if r.node != self.host
        ]
        try:
            prefer = {a.node for a in self.plan.assignments} if isinstance(self.plan, Plan) else set()
            p = plan(
                self.shape, Slot(self.host, host_rec.capacity), others, self.o.ctx_size,
                split=self.o.tensor_split, prefer=prefer,
            )  # fmt: skip
        except ValueError as e:
            p = Waiting(0, 0)
            log.warning("plan: %s", e)
        alive = {r.node for r in self.net.core.alive(now)}
        settled = self._plan_debounce.propose(p, now, urgent=plan_broken(self.plan, alive))
        if settled is None:
            return
        p = settled
        if p != self.plan:
            self.plan = p
            if isinstance(p, Waiting):
                self.console.print(f"[yellow]{p.message()}[/]")
            else:
                parts = [
                    f"{self._name(a.node)} layers {a.first}-{a.first + a.count - 1} ({a.bytes / GB:.2f} GB)"
                    for a in p.assignments if a.count
                ]  # fmt: skip
                standby = f"; standby: {', '.join(self._name(n) for n in p.standby)}" if p.standby else ""
                self.console.print(f"[bold]plan:[/] {'; '.join(parts)} + output on host{standby}")

    # ---------------------------------------------------------------- status

    def status(self, now: float) -> dict[str, object]:
        assert self.net is not None and self.net.core is not None
        core = self.net.core
        peers = []
        for r in core.alive(now):
            conn = self.net.peers.get(r.node)
            peers.append({
                "node": r.node.hex(), "short": crypto.short(r.node), "role": r.role, "capacity": r.capacity,
                "device": r.device, "state": r.state, "incarnation": r.incarnation,
                "liveness": core.liveness(r.node, now).value,
                "model": r.model.fingerprint if r.model else None,
                "path": "self" if r.node == self.me else (conn.path if conn else "not connected"),
                "pinned_key": (k.hex() if (k := conn.pinned_key) else None) if conn else None,
                "links": r.links, "relay": r.relay,
                "rtt_ms": core.rtt_ms.get(r.node),
                "tunnel": self._tunnel_counts(r.node),
                "layers": self._layers_of(r.node),
            })  # fmt: skip
        p = self.plan
        plan_obj: object = None
        if isinstance(p, Plan):
            plan_obj = {
                "host": p.host.hex(),
                "assignments": [
                    {"node": a.node.hex(), "first": a.first, "count": a.count, "bytes": a.bytes} for a in p.assignments
                ],
                "standby": [n.hex() for n in p.standby],
            }
        elif isinstance(p, Waiting):
            plan_obj = {"waiting": p.message(), "need": p.need, "have": p.have}
        api_host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        served = self._models()
        return {
            "api": f"http://{api_host}:{self.o.port}/v1",
            "state": self.server.state if self.server else core.record.state,
            "requests": dict(self.api.requests) if self.api else {},
            "llama_starts": self._server_generations + (self.server.restarts if self.server else 0),
            "draft": self.draft_path.name if self.draft_path else None,
            "served_models": served,
            "agent_lines": agent_lines(served[0], self.o.port) if served else [],
            "node": self.me.hex(), "mesh": core.mesh_id.hex(), "role": core.record.role,
            "host": self.host.hex() if self.host else None, "peers": peers, "plan": plan_obj,
            "reach": {
                "addrs": self.net.all_addrs, "public": self.net.nat.public, "relay_server": self.net.ep.relay_server,
                "relayed_packets": self.net.ep.stats.relayed_packets, "relayed_bytes": self.net.ep.stats.relayed_bytes,
                "relay_refused": self.net.ep.stats.relay_refused,
            },
            "model": self.facts.__dict__ if self.facts else None, "version": __version__,
        }  # fmt: skip

    def _tunnel_counts(self, node: NodeId) -> dict[str, int]:
        rpc = self.rpc_stats.get(node, TunnelStats())
        http = self.http_stats.get(node, TunnelStats())
        # bytes_up: what we sent to that peer through tunnels; bytes_down: what came back from it
        out = {"rpc_sent": rpc.bytes_up, "rpc_received": rpc.bytes_down, "rpc_tunnels": rpc.tunnels,
               "http_sent": http.bytes_up, "http_received": http.bytes_down}  # fmt: skip
        if rpc.rpc is not None:
            out["rpc_local_loads"] = rpc.rpc.commands[Cmd.SET_TENSOR_GGUF]
            if node in self._at_load:
                out["load_weight_bytes"], out["load_round_trips"], out["load_allocated"] = self._at_load[node]
        return out

    def _layers_of(self, node: NodeId) -> list[int] | None:
        if isinstance(self.plan, Plan):
            for a in self.plan.assignments:
                if a.node == node:
                    return [a.first, a.first + a.count - 1] if a.count else None
        return None

    def _write_status(self, now: float) -> None:
        text = json.dumps(self.status(now), indent=1, sort_keys=True)
        if text != self._last_status:
            self._last_status = text
            tmp = self.state / f".{STATUS_FILE}.tmp"
            tmp.write_text(text)
            tmp.replace(self.state / STATUS_FILE)


def _weights_and_trips(st: TunnelStats) -> tuple[int, int, int]:
    assert st.rpc is not None
    return (st.rpc.payload[Cmd.SET_TENSOR] + st.rpc.payload[Cmd.SET_TENSOR_HASH], st.rpc.round_trips,
            st.rpc.allocated)  # fmt: skip


def agent_lines(model: str, port: int) -> list[str]:
    """Ready-to-paste launch lines for coding agents, for the model actually served."""
    url = f"http://localhost:{port}/v1"
    provider = {"mesh": {"baseUrl": url, "api": "openai-completions", "apiKey": "mesh", "models": [{"id": model}]}}
    return [
        f"pi:    add to ~/.pi/agent/models.json: {json.dumps({'providers': provider})}",
        f"       then: pi --provider mesh --model {model}",
        f"goose: GOOSE_PROVIDER=openai OPENAI_HOST=http://localhost:{port} OPENAI_API_KEY=mesh "
        f"GOOSE_MODEL={model} goose session",
    ]


def find_by_fingerprint(where: Path, fingerprint: str, size: int) -> Path | None:
    """A GGUF file under ``where`` with this size and model fingerprint (only same-size files are hashed)."""
    if not where.is_dir():
        return None
    for path in sorted(where.rglob("*.gguf")):
        try:
            if path.stat().st_size != size:
                continue
            if model_fingerprint(path) == fingerprint:
                return path
        except (OSError, UserError):
            continue
    return None


def run_node(opts: NodeOptions, console: Console) -> int:
    node = Node(opts, console)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(node.run())
    return 130
