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
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console

from meshllm import __version__
from meshllm.errors import MeshError, UserError
from meshllm.llama.build import Binaries
from meshllm.llama.gguf import model_fingerprint, model_shape, read_header
from meshllm.llama.processes import port_in_use
from meshllm.net.meshnet import MeshNet, new_mesh
from meshllm.paths import state_dir as default_state_dir
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.gossip import ModelFacts, PeerRecord
from meshllm.proto.planner import GB, ModelShape, Plan, Slot, Waiting, plan
from meshllm.serve.api import Api, Unavailable, Upstream
from meshllm.serve.host import LocalServer, ServerConfig, default_threads
from meshllm.state import load_membership, load_or_create_key, save_membership, save_token, write_private

log = logging.getLogger("meshllm.node")
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
    token_ttl_s: float = 86400.0
    max_vram_gb: float | None = None
    ctx_size: int = 4096
    tensor_split: list[float] | None = None
    port: int = 9337
    listen_all: bool = False
    api_key: str | None = None
    bins: Binaries | None = None  # None: a lite client


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
        self._reconfig_task: asyncio.Future[None] | None = None

    # ---------------------------------------------------------------- setup (before anything listens)

    def prepare(self) -> list[tok.Token]:
        now = time.time()
        api_host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        if port_in_use(self.o.port, api_host):
            raise UserError(f"port {self.o.port} is in use: stop what runs there or pass --port N")
        m = load_membership(self.state)
        tokens = parse_tokens(self.o.join, now, m.mesh_id if m else None)  # before anything is written
        if self.o.model is not None:
            path = resolve_model(self.o.model)
            if not path.is_file():
                raise UserError(f"--model {path}: no such file")
            hdr = read_header(path)
            self.model_path = path
            self.shape = model_shape(hdr)
            named = path != self.o.model  # given by name: the API serves it under that name
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
            advertise=self.o.advertise or None, on_event=self._on_event,
        )  # fmt: skip
        self.net.on_change = self._on_change
        return tokens

    # ---------------------------------------------------------------- run

    async def run(self) -> int:
        tokens = self.prepare()
        assert self.net is not None
        await self._start_api()
        addrs = await self.net.start()
        cap, device = measure_capacity(self.o.max_vram_gb)
        self.capacity = cap
        self.net.update(
            role="client" if self.o.client else "worker", capacity=0 if self.o.client else cap, device=device,
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
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self._stop.wait()
        self.console.print("leaving the mesh")
        await self.net.stop(leave=True)
        if self.server:
            await self.server.stop()
        if self.api:
            await self.api.stop()
        return 0

    # ---------------------------------------------------------------- the API on :9337

    async def _start_api(self) -> None:
        host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        if port_in_use(self.o.port, host):
            raise UserError(f"port {self.o.port} is in use: stop what runs there or pass --port N")
        self.api = Api(self._route, self._models, lambda: self.status(time.time()), api_key=self.o.api_key)
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
        names = self._models()
        if model is not None and model not in names and names:
            return None
        if self.server is not None and self.server.state == "serving" and self.facts is not None:
            return Upstream(self.facts.source, self.server.base_url)
        if self.server is not None and self.server.state in ("loading", "failed"):
            return Unavailable(self.server.reason or f"the model is {self.server.state}")
        if isinstance(self.plan, Waiting):
            return Unavailable(self.plan.message())
        if self.host is None:
            return Unavailable("no host elected yet: waiting for peers")
        if self.host != self.me:
            return Unavailable(f"the host is {crypto.short(self.host)}; serving through it is not wired yet")
        return Unavailable("starting the model server")

    # ---------------------------------------------------------------- hosting

    def _reconfigure(self) -> None:
        """Run llama-server as the plan says, restarting it only when its configuration changes."""
        want: ServerConfig | None = None
        p = self.plan
        if (isinstance(p, Plan) and p.host == self.me and not p.workers and self.o.bins is not None
                and self.model_path is not None and self.facts is not None):  # fmt: skip
            want = ServerConfig(
                model=self.model_path, alias=self.facts.source, ctx_size=self.o.ctx_size, threads=default_threads()
            )
        if want == self._server_cfg:
            return
        self._server_cfg = want
        self._reconfig_task = asyncio.ensure_future(self._restart_server(want))

    async def _restart_server(self, cfg: ServerConfig | None) -> None:
        old, self.server = self.server, None
        if old:
            await old.stop()
        self._announced = False
        if cfg is None or self.o.bins is None:
            return
        self.server = LocalServer(self.o.bins, cfg, self.state)
        self.server.start()

    def _announce(self) -> None:
        if self._announced or self.server is None or self.server.state != "serving" or self.net is None:
            return
        self._announced = True
        self.net.update(state="serving")
        host = "0.0.0.0" if self.o.listen_all else "127.0.0.1"
        self.console.print(
            f"[bold green]ready:[/] http://{host}:{self.o.port}/v1 — model {self.facts.source if self.facts else '?'}"
        )

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
            path = f"direct {conn.addr[0]}:{conn.addr[1]}" if conn else "via gossip"
            rtt = self.net.core.rtt_ms.get(node)
            role = r.role if r else "?"
            cap = f"{r.capacity / GB:.1f} GB" if r and r.capacity else "no capacity"
            self.console.print(f"[green]+[/] peer {self._name(node)} joined: {role}, {cap}, {path}"
                               + (f", RTT {rtt:.1f} ms" if rtt is not None else ""))  # fmt: skip
        elif kind in ("left", "died"):
            how = "left" if kind == "left" else "went silent and is declared dead"
            self.console.print(f"[red]-[/] peer {self._name(node)} {how}")
        elif kind == "host":
            self.console.print(f"[bold]host elected:[/] {self._name(node)}")
        elif kind == "refuted":
            self.console.print(f"[yellow]was declared dead by a peer; back as {detail}[/]")

    def _on_change(self) -> None:
        net = self.net
        if net is None or net.core is None:
            return
        now = time.time()
        host = net.core.elected_host(now)
        self._flush()
        if host != self.host:
            self.host = host
            if not self.o.client and self.facts is not None:
                net.update(role="host" if host == self.me else "worker")
        self._replan(now)
        self._reconfigure()
        self._announce()
        self._write_status(now)

    def _flush(self) -> None:
        assert self.net is not None and self.net.core is not None
        for ev in self.net.core.events:
            self._on_event(ev.kind, ev.node, ev.detail)
        self.net.core.events.clear()

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
                "path": "self" if r.node == self.me else (f"direct {conn.addr[0]}:{conn.addr[1]}" if conn
                                                          else "gossip"),
                "rtt_ms": core.rtt_ms.get(r.node),
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
        return {
            "node": self.me.hex(), "mesh": core.mesh_id.hex(), "role": core.record.role,
            "host": self.host.hex() if self.host else None, "peers": peers, "plan": plan_obj,
            "model": self.facts.__dict__ if self.facts else None, "version": __version__,
        }  # fmt: skip

    def _write_status(self, now: float) -> None:
        text = json.dumps(self.status(now), indent=1, sort_keys=True)
        if text != self._last_status:
            self._last_status = text
            tmp = self.state / f".{STATUS_FILE}.tmp"
            tmp.write_text(text)
            tmp.replace(self.state / STATUS_FILE)


def resolve_model(arg: Path) -> Path:
    """A path, or the name of the tiny default model (the full catalog is the [models] issue)."""
    from meshllm.models.tiny import TINY_NAME, tiny_model_path

    if not arg.exists() and str(arg) in (TINY_NAME, "tiny"):
        return tiny_model_path()
    return arg


def run_node(opts: NodeOptions, console: Console) -> int:
    node = Node(opts, console)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(node.run())
    return 130
