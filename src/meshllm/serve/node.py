"""The one place that wires a node together: options, start-up, the mesh's events, the plan. Decisions live in pure
cores (``proto/``: election, planner, serving); what a node runs for the model and the paths to it in ``hosting.py``;
joining in ``joining.py``; console lines in ``narration.py``; status in ``report.py``; the API in ``api.py``. This
module gathers their inputs and applies their outputs, on every mesh change.
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
from rich.text import Text

from meshllm import __version__
from meshllm.errors import UserError
from meshllm.net.endpoint import STREAM_HTTP, STREAM_RPC, STREAM_RPC_KEY
from meshllm.net.meshnet import MeshNet
from meshllm.net.netevents import CHANGED, AddrsLearned, Changed, Connected, MeshEvent
from meshllm.paths import state_dir as default_state_dir
from meshllm.proto import crypto, serving, standing
from meshllm.proto import token as tok
from meshllm.proto.capacity import Offer
from meshllm.proto.crypto import NodeId
from meshllm.proto.debounce import Debouncer
from meshllm.proto.gossip import MAX_WHY, ModelFacts, NodeState, PeerRecord, Role
from meshllm.proto.meshcore import EventKind
from meshllm.proto.planner import GB, ModelShape, Plan, Sizing, Waiting, plan_broken, size, slots_for
from meshllm.serve import narration
from meshllm.serve.api import Api, Unavailable, Upstream
from meshllm.serve.hosting import Hosting
from meshllm.serve.joining import addresses_learned, enter_mesh, find_mesh_model, publish_token, remember_members
from meshllm.serve.modelfiles import ModelFiles
from meshllm.serve.options import NodeOptions, default_name, measure_offer
from meshllm.serve.report import NodeView, Report, agent_lines
from meshllm.serve.startup import start_checks
from meshllm.serve.telemetry import watch_llama
from meshllm.state import load_token, save_addrs

if TYPE_CHECKING:
    from meshllm.serve.console import Console as WebConsole

log = logging.getLogger("meshllm.node")
PLAN_DEBOUNCE_S = 2.0
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
        self.plan: Plan | Waiting | None = None
        self.elections = 0
        self.timeline: deque[dict[str, object]] = deque(maxlen=TIMELINE)  # what the console's timeline shows
        self._api_said: NodeId | None = None  # the host our "API up" line named
        self._routed: NodeId | None = None  # the host this node last routed to (elections counts changes)
        # joins come in bursts and a new plan costs a model load: adopt one once it has held for a moment
        self._plan_debounce = Debouncer[tuple[Plan | Waiting, Sizing]](PLAN_DEBOUNCE_S, first_at_once=True)
        self._stop = asyncio.Event()
        self._members: dict[NodeId, list[str]] = {}  # the members last saved for a restart
        self._tasks: list[asyncio.Future[None]] = []  # the node's own loops, cancelled at shutdown
        self._lock: int | None = None  # the state dir's lock (state.take_lock), held for the node's life
        self.exit_code = 0  # 1: stopped because this node is out of the mesh (revoked, or its admission ended)

    @property
    def facts(self) -> ModelFacts | None:
        return self.model.facts if self.model else None

    # ---------------------------------------------------------------- setup (before anything listens)

    def prepare(self) -> list[tok.Token]:
        s = start_checks(self.o, self.state, self.api_host, self.console)
        self._lock, self.model, self.shape, self.key, self.me = s.lock, s.model, s.shape, s.key, crypto.node_id(s.key)
        o = self.o
        self.net = net = MeshNet(self.key, s.membership, self.state, bind=(o.bind_host, s.udp_port),
                                 advertise=o.advertise or None, relay=o.relay_mode, relay_hint=o.relay,
                                 admit_s=o.admission_s)  # fmt: skip
        self.hosting = Hosting(net, o.bins, self.state, o.tuning, o.queue, o.draft_max, lambda: net.emit(CHANGED),
                               lambda: self.host, o.rpc_path, o.rpc_port)  # fmt: skip
        self.hosting.say = self._say
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
        assert self.net is not None and self.hosting is not None
        self._tasks.append(asyncio.ensure_future(self._events()))
        await self._start_api()
        await self.hosting.open_door(self._models, self.o.max_tokens)
        self.report = Report(self.net, self.hosting, self.api, self.api_host, self.o.port)
        self.net.stream_handlers[STREAM_RPC] = self.hosting.on_rpc_stream
        self.net.stream_handlers[STREAM_RPC_KEY] = self.hosting.on_rpc_key_stream
        self.net.stream_handlers[STREAM_HTTP] = self.hosting.on_http_stream
        self.offer = await measure_offer(self.o.bins, self.o.max_vram_gb)
        self.capacity, device = self.offer.capacity, self.offer.device
        if self.o.bins is not None and self.model is not None:
            await self.hosting.start_rpc_server(self.model, self.offer.use)
        addrs = await self.net.start()
        lite = self.o.client or self.model is None
        self.net.update(
            role=Role.CLIENT if lite else Role.WORKER, capacity=0 if lite else self.capacity, device=device,
            shares=() if lite else self.offer.shares, model=self.facts, state=NodeState.READY, version=__version__,
            name=self.o.name or default_name(),
        )  # fmt: skip
        save_addrs(self.state, addrs)
        self.console.print(
            f"node [bold]{crypto.short(self.me)}[/] listening on UDP {', '.join(addrs)}"
            + (f" — capacity {self.capacity / GB:.1f} GB ({device})" if not self.o.client else " — lite client")
        )
        redial = await enter_mesh(self.net, tokens, self.state, self.o.token_ttl_s, lite, self.console)
        self._tasks += [redial] if redial is not None else []
        if self.o.console_port is not None:
            from meshllm.serve.console import start_console

            self.web_console = await start_console(
                self.o.console_port, lambda: self.status(time.monotonic()), lambda: load_token(self.state),
                f"http://127.0.0.1:{self.o.port}/v1", self.o.api_key, self.console, self.o.max_tokens,
            )  # fmt: skip
        self._tasks.append(asyncio.ensure_future(watch_llama(self.net, self.hosting, self.api,
                                                             lambda: self.host == self.me)))  # fmt: skip
        if self.o.auto_model:
            await self._adopt_model()
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
        if self.api:
            await self.api.stop()
        if self.web_console is not None:
            await self.web_console.stop()

    async def _start_api(self) -> None:
        def metrics() -> str:
            serving = self._view().unavailable is None if self.hosting else False
            return self.report.metrics(self.me, self.elections, time.monotonic(), serving) if self.report else ""

        self.api = Api(self._route, self._models, lambda: self.status(time.monotonic()), api_key=self.o.api_key,
                       metrics=metrics, listen_all=self.o.listen_all, max_tokens=self.o.max_tokens)  # fmt: skip
        try:
            await self.api.start(self.api_host, self.o.port)
        except OSError as e:
            raise UserError(f"cannot listen on {self.api_host}:{self.o.port}: {e.strerror}") from None

    # ---------------------------------------------------------------- requests

    def _models(self) -> list[str]:
        return self.net.core.served_models(time.monotonic()) if self.net and self.net.core else []

    def _serving_host(self, model: str | None) -> NodeId | None:
        core = self.net.core if self.net else None
        return core.serving_host(model, time.monotonic()) if core else None

    def _route(self, model: str | None) -> Upstream | Unavailable | None:
        assert self.hosting is not None
        remote = self._serving_host(model)
        rec = self._record(remote) if remote else None
        name = rec.model.source if rec and rec.model else "?"
        served = (remote, name) if remote else None
        return self.hosting.upstream(model, self._models(), self.facts, served, self.plan, self.host, self.me,
                                     self._host_says())  # fmt: skip

    def _host_says(self) -> str:
        """Why the host this node routes to (its own election's, never a self-claim) cannot serve, from its record
        and its silence (``proto/standing.py``): the reason every node gives (503s, /health)."""
        core, now = self.net.core if self.net else None, time.monotonic()
        rec = core.host_record(now) if core else None
        if core is not None and rec is not None:
            return standing.host_says(rec, core.silent_s(rec.node, now))
        if self.host is not None and self.host != self.me:  # declared dead; our election has not moved on yet
            return f"the host {crypto.short(self.host)} is unreachable: electing another"
        return ""

    async def _adopt_model(self) -> None:
        """Joined without --model: serve the mesh's model as a worker if this machine has a copy."""
        assert self.net is not None and self.hosting is not None
        found = await find_mesh_model(self.net, self.o.models_dir, self.o.bins is not None, self.console)
        if found is not None:
            self.model, self.shape = found
            await self.hosting.start_rpc_server(self.model, self.offer.use)
            self.net.update(role=Role.WORKER, capacity=self.capacity, model=self.model.facts)

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
                    self.console.print(f"[cyan]~[/] connected to {narration.name(ev.node, self.me)}: {ev.path}")
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
        conn = self.net.peers.get(ev.node)
        path = conn.path if conn else "not connected yet"
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
            if remote != self._api_said and remote != self.me and remote in hosting.http_listeners:
                self._api_said = remote  # workers and lite clients say their API is up too (once per host)
                self._say(narration.api_line(self.api_host, self.o.port, self._record(remote), self.me), "ready")
        if self.report is not None:
            self.report.save(self._view(), now, self.state)
        self._members = remember_members(net, self.state, now, self._members, self.o.token_ttl_s)

    def _say_ready(self) -> None:
        model = self.facts.source if self.facts else "?"
        draft = f", draft {self.model.draft.name}" if self.model and self.model.draft else ""
        self._say(f"[bold green]ready:[/] http://{self.api_host}:{self.o.port}/v1 — model {model}{draft}", "ready")
        ctx = self.hosting.sizing.ctx if self.hosting else 0
        self.console.print("\n".join(agent_lines(model, self.o.port, ctx, bool(self.o.api_key))), markup=False)

    def _replan(self, now: float) -> None:
        assert self.net is not None and self.net.core is not None
        if self.host is None or self.shape is None or self.facts is None:
            return
        slots = slots_for(self.net.core.alive(now), self.host, self.facts.fingerprint)
        if slots is None:
            return
        host_rec = self._record(self.host)
        prefer = serving.keep_first(self.me, self.host, self.plan, host_rec.planned if host_rec else ())
        o = self.o
        sized = size(self.shape, *slots, o.parallel, o.ctx_size, o.tuning.cache_type, split=o.tensor_split,
                     prefer=prefer)  # fmt: skip
        alive = {r.node for r in self.net.core.alive(now)}
        got = self._plan_debounce.propose(sized, now, urgent=plan_broken(self.plan, alive))
        if got is None or (got[0] == self.plan and self.hosting is not None and got[1] == self.hosting.sizing):
            return
        settled, sizing = got
        self.plan = settled
        if self.hosting is not None:
            self.hosting.sizing = sizing  # with the plan it was sized for
        if self.host == self.me:  # every node keeps our plan's nodes first: they converge on the plan we run
            asg = settled.assignments if isinstance(settled, Plan) else ()
            self.net.update(planned=tuple(a.node for a in asg), layers=tuple((a.first, a.count) for a in asg),
                            why=settled.message()[:MAX_WHY] if isinstance(settled, Waiting) else "")  # fmt: skip
        self._say(narration.plan_line(settled, self.me), "plan")

    def _say(self, line: str, kind: str) -> None:
        """A line about the mesh: on the terminal, and in the timeline the console shows (plain text, wall time)."""
        self.console.print(line)
        self.timeline.append({"t": round(time.time(), 1), "kind": kind, "text": Text.from_markup(line).plain})

    def _view(self) -> NodeView:
        draft = self.model.draft.name if self.model and self.model.draft else None
        up = self._route(None) if self.hosting is not None else None
        why = up.reason if isinstance(up, Unavailable) else None if up is not None else "no model served yet"
        return NodeView(self.me, self.host, self.plan, self.facts, draft, self._models(), self.elections,
                        list(self.timeline), why)  # fmt: skip

    def status(self, now: float) -> dict[str, object]:
        assert self.report is not None
        return self.report.status(self._view(), now)


def run_node(opts: NodeOptions, console: Console) -> int:
    node = Node(opts, console)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(node.run())
    return 130
