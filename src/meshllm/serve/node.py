"""The one place that wires a node together: options, start-up, the mesh's events, the plan. Decisions live in pure
cores (``proto/``: election, planner, serving, standing, fleet); what a node runs in ``hosting.py``; its plan in
``replanning.py``; where a request goes in ``routing.py``; joining in ``joining.py`` and ``adoption.py``; lines in
``narration.py``; status in ``report.py``; the API in ``api.py``. This module applies their outputs at each change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from meshllm import __version__
from meshllm.errors import UserError
from meshllm.machine.state import save_addrs
from meshllm.net.meshnet import MeshNet
from meshllm.net.netevents import CHANGED, AddrsLearned, Changed, Connected, MeshEvent
from meshllm.paths import state_dir as default_state_dir
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.capacity import Offer
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import GB, ModelShape, Plan, Waiting
from meshllm.proto.meshcore import EventKind
from meshllm.proto.record import ModelFacts, NodeState, PeerRecord, Role
from meshllm.serve.fetch.fetching import LayerKeeper
from meshllm.serve.fetch.modelfiles import ModelFiles
from meshllm.serve.fetch.sharing import Sharing
from meshllm.serve.http.api import Api
from meshllm.serve.http.upstream import Unavailable
from meshllm.serve.life.adoption import Adoption
from meshllm.serve.life.joining import Members, addresses_learned, adopt_model, enter_mesh, publish_token
from meshllm.serve.life.startup import start_checks
from meshllm.serve.options import NodeOptions, default_name, measure_offer
from meshllm.serve.report import narration
from meshllm.serve.report.status import NodeView, Report, agent_lines
from meshllm.serve.split.hosting import Hosting
from meshllm.serve.split.replanning import Replanner
from meshllm.serve.split.routing import Router
from meshllm.serve.split.telemetry import watch_llama

if TYPE_CHECKING:
    from meshllm.serve.report.console import Console as WebConsole

log = logging.getLogger("meshllm.node")
TIMELINE = 50  # the latest mesh events kept for the console (joins, leaves, deaths, elections, plans, ready)


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
        self.web_console: WebConsole | None = None  # --console
        self.host: NodeId | None = None
        self.router: Router | None = None  # where a request goes
        self.replanner: Replanner | None = None  # the plan we follow
        self.layers: LayerKeeper | None = None  # a partial copy of the model: its layers kept to the plan
        self.adoption: Adoption | None = None  # --model auto, serving nothing: takes a model up when there is one
        self.elections = 0
        self.timeline: deque[dict[str, object]] = deque(maxlen=TIMELINE)  # what the console's timeline shows
        self._api_said: set[NodeId] = set()  # the hosts our "API up" lines named
        self._routed: NodeId | None = None  # the host this node last routed to (elections counts changes)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Future[None]] = []  # the node's own loops, cancelled at shutdown
        self._lock: int | None = None  # the state dir's lock (state.take_lock), held for the node's life
        self.exit_code = 0  # 1: stopped because this node is out of the mesh (revoked, or its admission ended)

    @property
    def plan(self) -> Plan | Waiting | None:
        return self.replanner.plan if self.replanner else None

    @property
    def facts(self) -> ModelFacts | None:
        return self.model.facts if self.model else None

    # ---------------------------------------------------------------- setup (before anything listens)

    def prepare(self) -> list[tok.Token]:
        s = start_checks(self.o, self.state, self.api_host, self.console)
        self._lock, self.model, self.shape, self.key, self.me = s.lock, s.model, s.shape, s.key, crypto.node_id(s.key)
        self.wanted = s.wanted
        o = self.o
        self.net = net = MeshNet(self.key, s.membership, self.state, bind=(o.bind_host, s.udp_port),
                                 advertise=o.advertise or None, relay=o.relay_mode, relay_hint=o.relay,
                                 admit_s=o.admission_s, relay_rate=o.relay_rate)  # fmt: skip
        self.hosting = Hosting(net, o.bins, self.state, o.tuning, o.queue, o.draft_max, lambda: net.emit(CHANGED),
                               lambda: self.host, o.rpc_path, o.rpc_port)  # fmt: skip
        self.hosting.say = self._say
        self.hosting.sharing = Sharing(s.key, self.state, lambda: {self.facts.fingerprint: self.model.path}
                                       if self.model and self.facts and not self.layers else {}, o.share,
                                       o.bind_host)  # fmt: skip
        self.router = Router(net, self.hosting, self.me, lambda: self.host, lambda: self.plan, lambda: self.facts)
        self.replanner = Replanner(net, self.hosting, o, self.me)
        self.members = Members(net, self.state)  # every member seen: dialled at a restart, and while apart
        return s.tokens

    # ---------------------------------------------------------------- run

    async def run(self) -> int:
        tokens = self.prepare()
        try:
            await self._serve(tokens)
            self.console.print("leaving the mesh")
        finally:  # a start that failed (no token's issuer answered, ...) stops what it started too
            await self._shutdown()
        return self.exit_code

    async def _serve(self, tokens: list[tok.Token]) -> None:
        """Start every part, then serve until told to stop."""
        assert self.net is not None and self.hosting is not None and self.router is not None and self.replanner
        self._tasks.append(asyncio.ensure_future(self._events()))
        await self._start_api()
        await self.hosting.open_door(self.router.models, self.o.max_tokens)
        self.report = Report(self.net, self.hosting, self.api, self.api_host, self.o.port)
        self.hosting.take_streams()  # RPC, RPC keys and API requests from peers
        self.offer = await measure_offer(self.o.bins, self.o.max_vram_gb, self.o.max_ram_gb)
        self.capacity, device = self.offer.capacity, self.offer.device
        if self.o.bins is not None and self.model is not None:
            await self.hosting.start_rpc_server(self.model, self.offer.served)
        addrs = await self.net.start()
        lite = self.o.client or self.model is None
        self.net.update(
            role=Role.CLIENT if lite else Role.WORKER, capacity=0 if lite else self.capacity, device=device,
            shares=() if lite else self.offer.shares, model=self.facts, state=NodeState.READY, version=__version__,
            name=self.o.name or default_name(), ram=0 if lite else self.offer.ram)  # fmt: skip
        save_addrs(self.state, addrs)
        self.console.print(
            f"node [bold]{crypto.short(self.me)}[/] listening on UDP {escape(', '.join(addrs))}"  # [v6]: not markup
            + (f" — capacity {self.capacity / GB:.1f} GB ({device})" if not self.o.client else " — lite client")
        )
        self._tasks += await enter_mesh(self.net, tokens, self.state, self.o, lite, self.members, self.console)
        if self.o.console_port is not None:
            from meshllm.serve.report.console import start_console

            self.web_console = await start_console(
                self.o.console_port, lambda: self.status(time.monotonic()), self.state,
                f"http://127.0.0.1:{self.o.port}/v1", self.o.api_key, self.console, self.o.max_tokens,
            )  # fmt: skip
        self._tasks.append(asyncio.ensure_future(watch_llama(self.net, self.hosting, self.api,
                                                             self.replanner.hosts)))  # fmt: skip
        if (self.o.auto_model or self.wanted) and (  # serve a model found here, fetched from peers, or downloaded
                found := await adopt_model(self.net, self.hosting, self.wanted, self.o, self.offer, self.console)):
            self.model, self.shape, self.layers = found
        self.adoption = Adoption(self.net, self.hosting, self.o, self.offer, self.console)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self._stop.wait()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.net is not None:
            await self.net.stop(leave=True)
        if self.hosting is not None:
            await self.hosting.stop()
        for part in (self.api, self.web_console):
            if part is not None:
                await part.stop()

    async def _start_api(self) -> None:
        def metrics() -> str:
            serving = self._view().unavailable is None if self.hosting else False
            return self.report.metrics(self.me, self.elections, time.monotonic(), serving) if self.report else ""

        r, o, h = self.router, self.o, self.hosting
        assert r is not None and h is not None
        self.api = Api(r.route, r.models, lambda: self.status(time.monotonic()), o.api_key, metrics, o.listen_all,
                       o.max_tokens, slot_ctx=h.slot_ctx, default_model=r.default_model)  # fmt: skip
        try:
            await self.api.start(self.api_host, self.o.port)
        except OSError as e:
            raise UserError(f"cannot listen on {self.api_host}:{self.o.port}: {e.strerror}") from None

    # ---------------------------------------------------------------- mesh events

    def _record(self, node: NodeId) -> PeerRecord | None:
        assert self.net is not None and self.net.core is not None
        return self.net.core.record if node == self.me else self.net.record(node)

    async def _events(self) -> None:
        """The node's one loop: the mesh's events, in order, each applied here."""
        assert self.net is not None
        while True:
            ev = await self.net.events.get()
            try:
                if isinstance(ev, Changed):
                    self.net.take_change()
                    self._on_change()
                elif isinstance(ev, MeshEvent):
                    self._on_event(ev)
                elif isinstance(ev, Connected):
                    self.console.print(f"[cyan]~[/] connected to {narration.name(ev.node, self.me)}: {escape(ev.path)}")
                elif isinstance(ev, AddrsLearned):
                    addresses_learned(self.net, self.state, list(ev.addrs), self.o.token_ttl_s, self.console)
            except Exception:  # our own bug: loud, and the node goes on with the next event
                log.exception("BUG: applying %s", ev)

    def _on_event(self, ev: MeshEvent) -> None:
        assert self.net is not None and self.net.core is not None
        if ev.kind in (EventKind.DIED, EventKind.LEFT) and self.hosting is not None:
            self.hosting.forget_worker(ev.node)  # its direct path is tried afresh when it comes back
        if ev.kind == EventKind.REKEYED:
            publish_token(self.net, self.state, self.o.token_ttl_s, self.console)  # the old one admits nobody now
        path = conn.path if (conn := self.net.peers.get(ev.node)) else "not connected yet"
        rtt = self.net.core.rtt_ms.get(ev.node)
        line = narration.event_line(ev.kind, ev.node, self.me, ev.detail, self._record(ev.node), path, rtt)
        if line:
            self._say(line, str(ev.kind))
        if ev.node == self.me and ev.kind in (EventKind.REVOKED, EventKind.EXPIRED):
            # no member takes this node any more: stop, rather than dial and be refused for ever
            self.console.print("[bold red]stopping: this node is no longer a member of the mesh[/]")
            self.exit_code = 1
            self._stop.set()

    def _on_change(self) -> None:
        net, hosting = self.net, self.hosting
        if net is None or net.core is None or hosting is None:
            return
        now = time.monotonic()
        host = net.core.elected_host(now)
        net.flush_events()
        routed = net.core.host_record(now)  # on a lite client too: host changes are counted on every node
        if routed is not None and routed.node != self._routed:
            self._routed, self.elections = routed.node, self.elections + 1
        adopted = self.replanner.step(now, host, self.shape, self.facts) if self.replanner else None
        if (layers_for := self.replanner.layer_host(host, now) if self.replanner else host) != self.host:
            self.host = layers_for  # the host we serve layers for: the elected one, or a replica's (replanning.py)
            hosting.gate.serve_layers_for(layers_for)
        if adopted is not None:
            self._say(narration.plan_line(adopted, self.me, host), "plan")
        if self.adoption is not None and (found := self.adoption.step(now, self.facts)):
            self.model, self.shape, self.layers = found
        if self.layers is not None:  # a partial copy: the layers the plan gives us
            self.layers.follow(self.plan, self.me)
        hosting.reconfigure(self.plan, self.me)
        if hosting.became_ready():
            self._say_ready()
        hosts = self.router.serving_hosts() if self.router else []  # every model's host, ourselves left out
        self._api_said &= set(hosts)  # a host that stopped serving is named again once it serves
        for h in hosts:
            hosting.door.open_listener(h)  # ready before the first request
            if h not in self._api_said and h in hosting.door.listeners:
                self._api_said.add(h)  # workers and lite clients say their API is up too (once per host)
                self._say(narration.api_line(self.api_host, self.o.port, self._record(h), self.me), "ready")
        if self.report is not None:
            self.report.save(self._view(), now, self.state)
        self.members.note(now, self.o.token_ttl_s)

    def _say_ready(self) -> None:
        model = self.facts.source if self.facts else "?"
        draft = f", draft {self.model.draft.name}" if self.model and self.model.draft else ""
        self._say(f"[bold green]ready:[/] http://{self.api_host}:{self.o.port}/v1 — model {model}{draft}", "ready")
        ctx = self.hosting.sizing.ctx if self.hosting else 0
        self.console.print("\n".join(agent_lines(model, self.o.port, ctx, bool(self.o.api_key))), markup=False)

    def _say(self, line: str, kind: str) -> None:
        """A line about the mesh: on the terminal, and in the timeline the console shows (plain text, wall time)."""
        self.console.print(line)
        self.timeline.append({"t": round(time.time(), 1), "kind": kind, "text": Text.from_markup(line).plain})

    def _view(self) -> NodeView:
        draft = self.model.draft.name if self.model and self.model.draft else None
        up = self.router.route(None) if self.router is not None else None
        why = up.reason if isinstance(up, Unavailable) else None if up is not None else "no model served yet"
        served = self.router.models() if self.router else []
        return NodeView(self.me, self.host, self.plan, self.facts, draft, served, self.elections, list(self.timeline),
                        why)  # fmt: skip

    def status(self, now: float) -> dict[str, object]:
        assert self.report is not None
        return self.report.status(self._view(), now)


def run_node(opts: NodeOptions, console: Console) -> int:
    node = Node(opts, console)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(node.run())
    return 130
