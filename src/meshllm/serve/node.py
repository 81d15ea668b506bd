"""The one place that wires a node together: options, start-up, the mesh's events, the plan.

Decisions live in pure cores (``proto/``: election, planner, serving); what a node runs for the model in
``hosting.py``; what it reports in ``report.py``; the API in ``api.py``. This module gathers their inputs and applies
their outputs, on every mesh change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from meshllm import __version__
from meshllm.errors import MeshError, UserError
from meshllm.llama.build import Binaries
from meshllm.llama.gguf import model_fingerprint, model_shape, read_header
from meshllm.llama.processes import device_listing, port_in_use
from meshllm.models.download import resolve
from meshllm.net.endpoint import STREAM_HTTP, STREAM_RPC, STREAM_RPC_KEY, Conn, Stream
from meshllm.net.meshnet import MeshNet, new_mesh
from meshllm.paths import models_dir
from meshllm.paths import state_dir as default_state_dir
from meshllm.proto import crypto, serving
from meshllm.proto import token as tok
from meshllm.proto.capacity import Offer, offer, parse_devices
from meshllm.proto.crypto import NodeId
from meshllm.proto.debounce import Debouncer
from meshllm.proto.gossip import ModelFacts, NodeState, PeerRecord, Role
from meshllm.proto.meshcore import EventKind
from meshllm.proto.planner import GB, ModelShape, Plan, Slot, Waiting, plan, plan_broken
from meshllm.proto.reach import RelayMode
from meshllm.serve.api import Api, Unavailable, Upstream
from meshllm.serve.hosting import Hosting, ModelFiles
from meshllm.serve.modelfiles import choose_draft, find_by_fingerprint
from meshllm.serve.report import NodeView, Report, agent_lines
from meshllm.state import (
    check_dir,
    load_membership,
    load_or_create_key,
    load_token,
    save_addrs,
    save_membership,
    save_status,
    save_token,
)

log = logging.getLogger("meshllm.node")
PLAN_DEBOUNCE_S = 2.0


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
    relay_mode: RelayMode = RelayMode.AUTO
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
    rpc_path: str = "auto"  # --rpc-path: "auto" (direct TLS where reachable, else tunnel) or "tunnel"
    models_dir: Path | None = None


async def measure_offer(bins: Binaries | None, max_gb: float | None) -> Offer:
    """Measured once at start: the free memory of the accelerator llama.cpp sees (a CPU node: its RAM), capped by
    ``--max-vram``."""
    listing = await asyncio.to_thread(device_listing, bins) if bins is not None else ""
    return offer(parse_devices(listing), psutil.virtual_memory().total, max_gb)


def parse_tokens(texts: list[str], now: float, mesh_id: bytes | None) -> list[tok.Token]:
    """Every --join token checked before anything starts: one clear line otherwise."""
    try:
        return [tok.check(tok.parse(t), now, mesh_id) for t in texts]
    except tok.TokenError as e:
        raise UserError(str(e)) from None


class Node:
    def __init__(self, opts: NodeOptions, console: Console) -> None:
        self.o = opts
        self.console = console
        self.state = default_state_dir(opts.state_dir)
        self.api_host = "0.0.0.0" if opts.listen_all else "127.0.0.1"
        self.key: Ed25519PrivateKey | None = None
        self.me: NodeId = b""
        self.capacity = 0
        self.offer = Offer(0, "cpu", None)
        self.shape: ModelShape | None = None
        self.model: ModelFiles | None = None
        self.net: MeshNet | None = None
        self.hosting: Hosting | None = None
        self.report: Report | None = None
        self.api: Api | None = None
        self.web_console: object = None  # serve.console.Console when --console
        self.host: NodeId | None = None
        self.plan: Plan | Waiting | None = None
        self.elections = 0
        # joins come in bursts and a new plan costs a model load: adopt one once it has held for a moment
        self._plan_debounce = Debouncer[Plan | Waiting](PLAN_DEBOUNCE_S, first_at_once=True)
        self._last_status = ""
        self._stop = asyncio.Event()

    @property
    def facts(self) -> ModelFacts | None:
        return self.model.facts if self.model else None

    # ---------------------------------------------------------------- setup (before anything listens)

    def prepare(self) -> list[tok.Token]:
        now = time.time()
        check_dir(self.state)  # before anything is written: the tokens first
        if port_in_use(self.o.port, self.api_host):
            raise UserError(f"port {self.o.port} is in use: stop what runs there or pass --port N")
        m = load_membership(self.state)
        tokens = parse_tokens(self.o.join, now, m.mesh_id if m else None)  # before anything is written
        if self.o.model is not None:
            path = resolve(str(self.o.model), self.o.models_dir)
            if not path.is_file():
                raise UserError(f"--model {path}: no such file")
            hdr = read_header(path)
            self.shape = model_shape(hdr)
            named = path != self.o.model and "/" not in str(self.o.model)  # by name: served under that name
            draft, note = choose_draft(str(self.o.model), path, hdr, self.o.draft, self.o.no_draft, self.o.models_dir)
            if note:
                self.console.print(note)
            facts = ModelFacts(
                fingerprint=model_fingerprint(path), size=path.stat().st_size,
                n_layer=self.shape.n_layer, source=str(self.o.model) if named else path.stem,
            )  # fmt: skip
            self.model = ModelFiles(path, facts, draft)
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
        self.net.on_connect = lambda node, path: self.console.print(
            f"[cyan]~[/] connected to {self._name(node)}: {path}"
        )
        self.hosting = Hosting(
            self.net, self.o.bins, self.state, self.o.ctx_size, self.o.draft_max, self._on_change, self.o.rpc_path
        )
        return tokens

    # ---------------------------------------------------------------- run

    async def run(self) -> int:
        tokens = self.prepare()
        assert self.net is not None and self.hosting is not None
        await self._start_api()
        self.report = Report(self.net, self.hosting, self.api, self.api_host, self.o.port)
        self.net.stream_handlers[STREAM_RPC] = self._on_rpc_stream
        self.net.stream_handlers[STREAM_RPC_KEY] = self._on_rpc_key_stream
        self.net.stream_handlers[STREAM_HTTP] = self.hosting.on_http_stream
        self.offer = await measure_offer(self.o.bins, self.o.max_vram_gb)
        self.capacity, device = self.offer.capacity, self.offer.device
        if self.o.bins is not None and self.model is not None:
            await self.hosting.start_rpc_server(self.model, self.offer.use)
        addrs = await self.net.start()
        lite = self.o.client or self.model is None
        self.net.update(
            role=Role.CLIENT if lite else Role.WORKER, capacity=0 if lite else self.capacity, device=device,
            model=self.facts, state=NodeState.READY, version=__version__,
        )  # fmt: skip
        save_addrs(self.state, addrs)
        self.console.print(
            f"node [bold]{crypto.short(self.me)}[/] listening on UDP {', '.join(addrs)}"
            + (f" — capacity {self.capacity / GB:.1f} GB ({device})" if not self.o.client else " — lite client")
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
        await self.hosting.stop()
        if self.api:
            await self.api.stop()
        if self.web_console is not None:
            await self.web_console.stop()  # type: ignore[attr-defined]
        return 0

    async def _start_api(self) -> None:
        if port_in_use(self.o.port, self.api_host):
            raise UserError(f"port {self.o.port} is in use: stop what runs there or pass --port N")
        self.api = Api(self._route, self._models, lambda: self.status(time.time()), api_key=self.o.api_key,
                       metrics=self._metrics)  # fmt: skip
        try:
            await self.api.start(self.api_host, self.o.port)
        except OSError as e:
            raise UserError(f"cannot listen on {self.api_host}:{self.o.port}: {e.strerror}") from None

    async def _start_console(self, port: int) -> None:
        from meshllm.serve.console import Console as WebConsole

        web = WebConsole(
            lambda: self.status(time.time()),
            lambda: load_token(self.state),
            f"http://127.0.0.1:{self.o.port}/v1",
            self.o.api_key,
        )
        self.web_console = web
        try:
            await web.start(port)
        except OSError as e:
            raise UserError(f"--console: cannot listen on 127.0.0.1:{port}: {e.strerror}") from None
        self.console.print(f"console: http://127.0.0.1:{port}/")

    # ---------------------------------------------------------------- requests

    def _models(self) -> list[str]:
        core = self.net.core if self.net else None
        return sorted({r.model.source for r in core.alive(time.time()) if r.model}) if core else []

    def _serving_host(self, model: str | None) -> NodeId | None:
        core = self.net.core if self.net else None
        return core.serving_host(model, time.time()) if core else None

    def _route(self, model: str | None) -> Upstream | Unavailable | None:
        assert self.hosting is not None
        srv = self.hosting.server
        local = serving.LocalServing(self.facts.source, srv.state, srv.reason) if srv and self.facts else None
        remote = self._serving_host(model)
        rec = self._record(remote) if remote else None
        name = rec.model.source if rec and rec.model else "?"
        listeners = self.hosting.http_listeners
        r = serving.route(model, self._models(), local, (remote, name) if remote else None, remote in listeners,
                          self.plan, self.host, self.me)  # fmt: skip
        if isinstance(r, serving.Local):
            assert srv is not None
            return Upstream(r.model, srv.base_url)
        if isinstance(r, serving.Remote):
            return Upstream(r.model, f"http://127.0.0.1:{listeners[r.host].port}")
        if isinstance(r, serving.Connecting):
            self.hosting.open_http_listener(r.host)
            return Unavailable("connecting to the host", retry_after_s=r.retry_after_s)
        if isinstance(r, serving.Busy):
            return Unavailable(r.reason, retry_after_s=r.retry_after_s)
        return None

    async def _on_rpc_stream(self, conn: Conn, st: Stream) -> None:
        """Worker side: only the elected host may reach our rpc-server (anyone reaching it owns the machine)."""
        assert self.hosting is not None
        peer = conn.peer
        if peer is None or not serving.may_open_rpc(peer, self.host, self.hosting.rpc_up()):
            log.warning("refused an RPC tunnel from %s: not the elected host", crypto.short(peer) if peer else "?")
            st.reset()
            return
        await self.hosting.bridge_rpc(peer, st)

    async def _on_rpc_key_stream(self, conn: Conn, st: Stream) -> None:
        """Worker side: the key of our rpc-server's direct (TLS) listener, for the elected host alone."""
        assert self.hosting is not None
        peer = conn.peer
        key = None
        if peer is not None and serving.may_open_rpc(peer, self.host, self.hosting.rpc_up()):
            key = self.hosting.issue_rpc_key(peer)
        if key is None:
            if not (peer is not None and peer == self.host):
                log.warning("refused an RPC key to %s: not the elected host", crypto.short(peer) if peer else "?")
            st.reset()
            return
        with contextlib.suppress(ConnectionError):
            st.write(key.encode(), end=True)

    # ---------------------------------------------------------------- joining, tokens, models

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

    def _print_token(self) -> None:
        assert self.net is not None
        t = self.net.mint_token(self.o.token_ttl_s)
        path = save_token(self.state, t.encode())
        if sys.stdout.isatty():
            self.console.print(f"invite token (valid {self.o.token_ttl_s / 3600:.0f} h, also in {path}):")
            print(t.encode(), flush=True)
        else:  # stdout is a file or a pipe, perhaps a log: keep the secret out of it
            self.console.print(f"invite token written to {path} (mode 0600); `mesh-llm token` prints a new one")

    async def _adopt_model(self) -> None:
        """Joined without --model: find the mesh's model on this machine by fingerprint (any file name) and
        serve it as a worker; otherwise stay a lite client and say why."""
        assert self.net is not None and self.hosting is not None
        facts = None
        for _ in range(40):
            if (facts := self._mesh_model()) is not None:
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
        self.shape = model_shape(read_header(found))
        self.model = ModelFiles(found, facts)
        await self.hosting.start_rpc_server(self.model, self.offer.use)
        self.net.update(role=Role.WORKER, capacity=self.capacity, model=facts)

    def _mesh_model(self) -> ModelFacts | None:
        core = self.net.core if self.net else None
        if core is None:
            return None
        recs = [r for r in core.table.alive(time.time()) if r.model is not None and r.role != Role.CLIENT]
        recs.sort(key=lambda r: (r.role != Role.HOST, r.node))
        return recs[0].model if recs else None

    # ---------------------------------------------------------------- mesh events

    def _name(self, node: NodeId) -> str:
        return crypto.short(node) + (" (me)" if node == self.me else "")

    def _record(self, node: NodeId) -> PeerRecord | None:
        assert self.net is not None and self.net.core is not None
        return self.net.core.record if node == self.me else self.net.record(node)

    def _on_event(self, kind: EventKind, node: NodeId, detail: str) -> None:
        assert self.net is not None and self.net.core is not None
        if kind == EventKind.JOINED:
            r = self._record(node)
            conn = self.net.peers.get(node)
            path = conn.path if conn else "not connected yet"
            rtt = self.net.core.rtt_ms.get(node)
            cap = f"{r.capacity / GB:.1f} GB" if r and r.capacity else "no capacity"
            self.console.print(f"[green]+[/] peer {self._name(node)} joined: {r.role if r else '?'}, {cap}, {path}"
                               + (f", RTT {rtt:.1f} ms" if rtt is not None else ""))  # fmt: skip
        elif kind in (EventKind.LEFT, EventKind.DIED):
            how = "left" if kind == EventKind.LEFT else "went silent and is declared dead"
            self.console.print(f"[red]-[/] peer {self._name(node)} {how}")
        elif kind == EventKind.HOST:
            self.elections += 1
            self.console.print(f"[bold]host elected:[/] {self._name(node)}")
        elif kind == EventKind.REFUTED:
            self.console.print(f"[yellow]was declared dead by a peer; back as {detail}[/]")

    def _on_connect(self, node: NodeId, path: str) -> None:
        self.console.print(f"[cyan]~[/] connected to {self._name(node)}: {path}")

    def _on_addrs(self, addrs: list[str]) -> None:
        """Members told us our public address: later tokens carry it."""
        save_addrs(self.state, addrs)
        self.console.print(f"addresses as members see them: {', '.join(addrs[:3])}")
        if self.net is not None and self.net.m is not None and load_token(self.state) is not None:
            save_token(self.state, self.net.mint_token(self.o.token_ttl_s).encode())

    def _on_change(self) -> None:
        net, hosting = self.net, self.hosting
        if net is None or net.core is None or hosting is None:
            return
        now = time.time()
        host = net.core.elected_host(now)
        net.flush_events()
        if host != self.host:
            self.host = host
            hosting.drop_stale_tunnels(host)
            if not self.o.client and self.facts is not None:
                net.update(role=Role.HOST if host == self.me else Role.WORKER)
        self._replan(now)
        hosting.reconfigure(self.plan, self.me)
        if hosting.became_ready():
            self._say_ready()
        remote = self._serving_host(None)
        if remote is not None:
            hosting.open_http_listener(remote)  # ready before the first request
        self._write_status(now)

    def _say_ready(self) -> None:
        model = self.facts.source if self.facts else "?"
        draft = f", draft {self.model.draft.name}" if self.model and self.model.draft else ""
        self.console.print(f"[bold green]ready:[/] http://{self.api_host}:{self.o.port}/v1 — model {model}{draft}")
        for line in agent_lines(model, self.o.port):
            self.console.print(line, markup=False)

    def _replan(self, now: float) -> None:
        assert self.net is not None and self.net.core is not None
        if self.host is None or self.shape is None or self.facts is None:
            return
        fp = self.facts.fingerprint
        recs = [r for r in self.net.core.alive(now) if r.model and r.model.fingerprint == fp and r.role != Role.CLIENT]
        host_rec = next((r for r in recs if r.node == self.host), None)
        if host_rec is None:
            return
        rtt = host_rec.rtt_ms
        others = [Slot(r.node, r.capacity, rtt.get(crypto.short(r.node), 0.0)) for r in recs if r.node != self.host]
        try:
            prefer = {a.node for a in self.plan.assignments} if isinstance(self.plan, Plan) else set()
            p: Plan | Waiting = plan(
                self.shape, Slot(self.host, host_rec.capacity), others, self.o.ctx_size,
                split=self.o.tensor_split, prefer=prefer,
            )  # fmt: skip
        except ValueError as e:
            p = Waiting(0, 0)
            log.warning("plan: %s", e)
        alive = {r.node for r in self.net.core.alive(now)}
        settled = self._plan_debounce.propose(p, now, urgent=plan_broken(self.plan, alive))
        if settled is None or settled == self.plan:
            return
        self.plan = settled
        if isinstance(settled, Waiting):
            self.console.print(f"[yellow]{settled.message()}[/]")
            return
        parts = [f"{self._name(a.node)} layers {a.first}-{a.first + a.count - 1} ({a.bytes / GB:.2f} GB)"
                 for a in settled.assignments if a.count]  # fmt: skip
        standby = f"; standby: {', '.join(self._name(n) for n in settled.standby)}" if settled.standby else ""
        self.console.print(f"[bold]plan:[/] {'; '.join(parts)} + output on host{standby}")

    # ---------------------------------------------------------------- status

    def status(self, now: float) -> dict[str, object]:
        assert self.report is not None
        draft = self.model.draft.name if self.model and self.model.draft else None
        view = NodeView(self.me, self.host, self.plan, self.facts, draft, self._models(), self.elections)
        return self.report.status(view, now)

    def _metrics(self) -> str:
        return self.report.metrics(self.me, self.elections, time.time()) if self.report else ""

    def _write_status(self, now: float) -> None:
        if self.report is None:
            return
        text = json.dumps(self.status(now), indent=1, sort_keys=True)
        if text != self._last_status:
            self._last_status = text
            save_status(self.state, text)


def run_node(opts: NodeOptions, console: Console) -> int:
    node = Node(opts, console)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(node.run())
    return 130
