"""What a node tells about itself: the status JSON (``/mesh/status``, ``status.json``, ``mesh-llm status``, the
console), the Prometheus text of ``/metrics``, and the agent launch lines. Reads, never changes, the node's parts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from meshllm import __version__
from meshllm.machine.state import save_status
from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto, fleet, standing
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import Plan, Waiting
from meshllm.proto.record import ModelFacts, PeerRecord, Role
from meshllm.proto.standing import Standing
from meshllm.serve.http.api import Api
from meshllm.serve.http.metrics import Exposition
from meshllm.serve.split.hosting import Hosting


@dataclass(frozen=True)
class NodeView:
    """What only the node's wiring knows, at one moment."""

    me: NodeId
    host: NodeId | None
    plan: Plan | Waiting | None
    model: ModelFacts | None
    draft: str | None
    served: list[str]
    elections: int
    events: list[dict[str, object]] = field(default_factory=list)  # the timeline: {t, kind, text}, oldest first
    unavailable: str | None = None  # why this node's API answers 503 now (what /health says); None: it serves


class MeshTokens(NamedTuple):
    host: str  # short id of the host serving now
    generated: int  # by every host this node has seen, running requests included (a dead host's count stays)
    prompt: int
    progress: int  # percent of the model loaded while the host loads it; -1 otherwise
    rate: float  # tokens per second the host generates now


class Report:
    def __init__(self, net: MeshNet, hosting: Hosting, api: Api | None, api_host: str, port: int) -> None:
        self.keyed = bool(api and api.api_key)  # the API requires a key: the agent lines read it from the environment
        self.net = net
        self.hosting = hosting
        self.api = api
        self.api_host = api_host
        self.port = port
        self._saved = ""
        self._tokens = standing.Tally(2)  # every host's (generated, prompt): mesh-wide, kept when a host dies
        self._model_tokens: dict[str, standing.Tally] = {}  # the same per model (fingerprint)
        self._firsts = standing.Tally(2)  # every node's (requests, summed ms to the first token)
        if api is not None:  # /v1/models names each model's host and nodes; a request names a dropped model
            api.model_info = self.model_info
            api.dropped = lambda name: net.core is not None and net.core.table.dropped(name)
            api.known = lambda: net.core.known_models if net.core is not None else ()

    def models(self, now: float) -> list[dict[str, object]]:
        """Each model the mesh serves: its name, fingerprint, host (our election's) and the nodes that hold it."""
        core = self.net.core
        if core is None:
            return []
        out: list[dict[str, object]] = []
        self._see(now)
        alive = {r.node: r for r in core.alive(now)}
        for g in fleet.model_groups(alive.values(), lambda r: core.host_of(r, now)):
            host = g.host
            stand = self.standing(host, now) if host is not None else None
            # each model's own figures, from its hosts (the elected one and its replicas, summed)
            hosts = ([host] if host else []) + [alive[n] for n in g.replicas if n in alive]
            tally = self._model_tokens.get(g.fingerprint)
            generated, prompt = tally.total() if tally else (0, 0)
            out.append({"name": g.name, "fingerprint": g.fingerprint, "host": host.node.hex() if host else None,
                        "nodes": [n.hex() for n in g.nodes], "replicas": [n.hex() for n in g.replicas],
                        "state": str(stand.state) if stand else "waiting",
                        "why": stand.why if stand else "no host elected yet",
                        "tokens": {"generated": generated, "prompt": prompt,
                                   "rate": round(sum(h.rate for h in hosts), 1)},
                        "slots": {"busy": sum(h.slots[0] for h in hosts), "total": sum(h.slots[1] for h in hosts),
                                  "queued": sum(h.slots[2] for h in hosts),
                                  "ctx": host.slots[3] if host else 0}})  # fmt: skip
        return out

    def model_info(self, name: str) -> dict[str, object] | None:
        """What /v1/models adds to the model ``name``: its host and nodes (short ids), its fingerprint."""
        m = next((m for m in self.models(time.monotonic()) if m["name"] == name), None)
        if m is None:
            return None
        host, nodes, reps = m["host"], m["nodes"], m["replicas"]
        assert isinstance(nodes, list) and isinstance(reps, list)
        return {"fingerprint": m["fingerprint"], "host": str(host)[:8] if host else None,
                "replicas": [str(n)[:8] for n in reps], "nodes": [str(n)[:8] for n in nodes],
                "state": m["state"]}  # fmt: skip

    def save(self, v: NodeView, now: float, state_dir: Path) -> None:
        """The status into the state dir's status.json, when it changed (``mesh-llm status`` reads it)."""
        text = json.dumps(self.status(v, now), indent=1, sort_keys=True)
        if text != self._saved:
            self._saved = text
            save_status(state_dir, text)

    def _ttft(self) -> dict[str, object] | None:
        """This node's time to first token: the last one and the median (of its histogram's buckets)."""
        h = self.api.counters.ttft if self.api else None
        if h is None or not h.n:
            return None
        return {"last": _fmt(h.last), "p50": _fmt(h.quantile(0.5)), "count": h.n}

    def _see(self, now: float) -> None:
        """Fold every live record's counts into the mesh-wide tallies (what a node reported before it died stays)."""
        for r in self.net.core.alive(now) if self.net.core is not None else []:
            if r.served != (0, 0):
                self._tokens.see(r.node, r.served)
                if r.model is not None:
                    self._model_tokens.setdefault(r.model.fingerprint, standing.Tally(2)).see(r.node, r.served)
            if r.ttft != (0, 0):
                self._firsts.see(r.node, r.ttft)

    def mesh_ttft(self, now: float) -> dict[str, object] | None:
        """Time to first token over every node's requests (each node's own count and sum, from gossip)."""
        self._see(now)
        n, total_ms = self._firsts.total()
        return {"count": n, "avg": round(total_ms / n / 1000, 3)} if n else None

    def slots(self, now: float) -> tuple[int, int, int, int]:
        """The slots of the model this node routes to, as its hosts gossip them (the elected one and its replicas,
        summed): busy, in all, requests waiting; the elected host's context per slot."""
        core = self.net.core
        host = core.host_record(now) if core is not None else None
        if core is None or host is None:
            return (0, 0, 0, 0)
        hosts = self._hosts_of(host, now)
        return (sum(h.slots[0] for h in hosts), sum(h.slots[1] for h in hosts), sum(h.slots[2] for h in hosts),
                host.slots[3])  # fmt: skip

    def _hosts_of(self, host: PeerRecord, now: float) -> list[PeerRecord]:
        """``host`` and the replicas of its model."""
        core = self.net.core
        assert core is not None
        fp = host.model.fingerprint if host.model else None
        return [host] + [r for r in core.alive(now) if r.replica and r.role == Role.HOST and r.node != host.node
                         and r.model is not None and r.model.fingerprint == fp]  # fmt: skip

    def mesh_tokens(self, now: float) -> MeshTokens | None:
        """What the hosts say their llama-servers did, for every node's requests (every completion runs on a host),
        summed over every host this node has seen; the rate and load progress of the one serving now."""
        core = self.net.core
        if core is None:
            return None
        self._see(now)
        host = core.host_record(now)
        generated, prompt = self._tokens.total()
        if host is None and not generated:
            return None
        short = crypto.short(host.node) if host else ""
        rate = sum(h.rate for h in self._hosts_of(host, now)) if host else 0.0  # replicas generate too
        return MeshTokens(short, generated, prompt, host.progress if host else -1, rate)

    def standing(self, r: PeerRecord, now: float) -> standing.Standing:
        """Where ``r``'s node stands, as every node computes it (``proto/standing.py``)."""
        return self.where(r, now)[0]

    def where(self, r: PeerRecord, now: float) -> tuple[Standing, str]:
        """``r``'s standing and the one word it goes by (``standing.label``), from one look-up of its host."""
        core = self.net.core
        assert core is not None
        host = elected = core.host_of(r, now)
        if host is not None and r.node not in host.planned and r.model is not None:  # a split replica's worker
            fp = r.model.fingerprint
            host = next((h for h in core.alive(now) if h.replica and h.node != r.node and r.node in h.planned
                         and h.model is not None and h.model.fingerprint == fp), host)  # fmt: skip
        stand = standing.of_node(r, core.silent_s(r.node, now), host, core.silent_s(host.node, now) if host else 0)
        word = standing.label(r.role, r.replica, elected is not None and elected.node == r.node, stand.state)
        return stand, word

    def status(self, v: NodeView, now: float) -> dict[str, object]:
        assert self.net.core is not None
        core = self.net.core
        peers = []
        for r in core.alive(now):
            conn = self.net.peers.get(r.node)
            stand, word = self.where(r, now)
            peers.append({
                "node": r.node.hex(), "short": crypto.short(r.node), "name": r.name,
                "role": "replica" if r.replica and r.role == Role.HOST else r.role,
                "label": word,  # the word the console and the table show
                "scope": str(r.scope),
                "capacity": r.capacity,
                "ram": r.ram,  # offered beside capacity, for routed experts
                "device": r.device, "state": str(stand.state), "why": stand.why, "incarnation": r.incarnation,
                "liveness": core.liveness(r.node, now).value,
                "model": r.model.fingerprint if r.model else None,
                "held": [list(x) for x in r.held] if r.held is not None else None,  # a partial copy's layers
                # a host (a replica too): its llama-server's slots busy, in all, requests waiting
                "slots": list(r.slots[:3]) if r.role == Role.HOST else None,
                "path": "self" if r.node == v.me else (conn.path if conn else "not connected"),
                "pinned_key": (k.hex() if (k := conn.pinned_key) else None) if conn else None,
                "links": {crypto.short(k): v for k, v in r.links.items()}, "relay": r.relay,
                "rtt_ms": core.rtt_ms.get(r.node),
                "tunnel": self.hosting.tunnel_counts(r.node),
                "rpc_path": self.hosting.rpc_path_of(r.node) or None,  # host: how llama-server reaches it
                "layers": layers_of(v.plan if _same_model(r, v.model) else None, r.node,
                                    r if r.replica else core.host_of(r, now)),  # a replica: its own plan's
                "planned_bytes": planned_bytes(v.plan, r.node),  # of its capacity, what the plan puts on it
                "planned_ram_bytes": planned_ram_bytes(v.plan, r.node),  # of its RAM
            })  # fmt: skip
        p = v.plan
        plan_obj: object = None
        if isinstance(p, Plan):
            plan_obj = {
                "host": p.host.hex(),
                "assignments": [
                    {
                        "node": a.node.hex(),
                        "first": a.first,
                        "count": a.count,
                        "bytes": a.bytes,
                        "devices": len(a.shares) or 1,
                        "experts_in_ram": list(a.spilled), "ram_bytes": a.ram_bytes,  # what the plan keeps in RAM
                        "cpu_device": a.cpu_last,  # its rpc-server serves its CPU too (an entry 0 in the split)
                    }
                    for a in p.assignments
                ],
                "standby": [n.hex() for n in p.standby],
                "tensor_split": list(p.tensor_split),  # what llama-server is given: one entry per device
                "embd_first": p.embd_first,  # the token embedding on the first worker (patch 0013)
                "ram_layers": p.ram_layers,  # layers [0, ram_layers) whole in the host's RAM
                "n_gpu_layers": p.n_gpu_layers,  # what llama-server is given then (None: every layer offloaded)
            }
        elif isinstance(p, Waiting):
            plan_obj = {"waiting": p.message(), "need": p.need, "have": p.have}
        ep = self.net.ep
        return {
            "api": f"http://{self.api_host}:{self.port}/v1",
            "state": str((mine := self.where(core.record, now))[0].state), "why": mine[0].why,
            "in_flight": self.api.in_flight if self.api else 0,
            "last_tokens_per_second": self.api.counters.last_tokens_per_second if self.api else 0.0,
            "requests": dict(self.api.requests) if self.api else {},
            "llama_starts": self.hosting.generations + (srv.restarts if (srv := self.hosting.server) else 0),
            "draft": v.draft,
            "served_models": v.served,
            "models": self.models(now),
            "dropped": sorted(n for n in core.table.directives if core.table.dropped(n)),  # `mesh-llm drop`
            "agents": [{"label": a, "copy": b} for a, b in agent_commands(v.served[0], self.port, self.slots(now)[3],
                                                                          self.keyed)] if v.served else [],
            "slots": dict(zip(("busy", "total", "queued", "ctx"), self.slots(now), strict=True)),
            "node": v.me.hex(), "mesh": core.mesh_id.hex(),
            "role": "replica" if core.record.replica else core.record.role,
            "label": mine[1],
            "host": v.host.hex() if v.host else None, "peers": peers, "plan": plan_obj,
            "plan_served": self.hosting.serves_plan(),  # the host: its llama-server serves that plan now
            "reach": {
                "addrs": self.net.all_addrs, "public": self.net.nat.public, "relay_server": ep.relay_server,
                "relayed_packets": ep.stats.relayed_packets, "relayed_bytes": ep.stats.relayed_bytes,
                "relay_refused": ep.stats.relay_refused, "relay_capped": ep.stats.relay_capped,
                "relay_rate": ep.relay_budget.rate, "relay_pairs": ep.relay_budget.pairs(time.monotonic()),
            },
            "model": v.model.__dict__ if v.model else None, "version": __version__,
            "events": v.events,
            "unavailable": v.unavailable,
            "mesh_tokens": (mt._asdict() if (mt := self.mesh_tokens(now)) else None),
            "ttft_s": self._ttft(),
            "fetch": f.fetching.as_dict() if (f := self.hosting.sharing) and f.fetching else None,
            "mesh_ttft_s": self.mesh_ttft(now),
        }  # fmt: skip

    def metrics(self, me: NodeId, elections: int, now: float, serving: bool = False) -> str:
        """``serving``: this node's API can answer completions now (what /health says)."""
        x = Exposition()
        x.metric("mesh_llm_serving", "gauge", "1 when this node's API can answer completions now (as /health)",
                 1 if serving else 0)  # fmt: skip
        x.metric("mesh_llm_requests_in_flight", "gauge", "requests this node's API passes on now (or that wait for "
                 "a slot)", self.api.in_flight if self.api else 0)  # fmt: skip
        c = self.api.counters if self.api else None
        if c is not None:
            x.metric("mesh_llm_tokens_generated_total", "counter", "tokens generated through this node's API",
                     c.tokens_generated)  # fmt: skip
            x.metric("mesh_llm_decode_seconds_total", "counter", "llama-server's decode time of those tokens",
                     c.decode_seconds)  # fmt: skip
            x.metric("mesh_llm_tokens_per_second", "gauge", "decode speed of the last completion",
                     c.last_tokens_per_second)  # fmt: skip
            x.histogram("mesh_llm_request_seconds", "completion and chat requests through this node's API, start to "
                        "end", c.duration)  # fmt: skip
            x.histogram("mesh_llm_time_to_first_token_seconds", "from a request through this node's API to its "
                        "first generated token", c.ttft)  # fmt: skip
        for code, n in sorted((self.api.requests if self.api else {}).items()):
            x.metric("mesh_llm_requests_total", "counter", "API requests by status", n, {"status": str(code)})
        mesh = self.mesh_tokens(now)
        if mesh is not None:
            x.metric("mesh_llm_mesh_tokens_generated_total", "counter", "tokens the mesh's hosts generated for every "
                     "node's requests, running ones included (from their gossip; kept when a host dies)",
                     mesh.generated)  # fmt: skip
            x.metric("mesh_llm_mesh_prompt_tokens_total", "counter", "prompt tokens the mesh's hosts processed",
                     mesh.prompt)  # fmt: skip
            x.metric("mesh_llm_mesh_tokens_per_second", "gauge", "tokens per second the serving host generates now",
                     mesh.rate)  # fmt: skip
        for m in self.models(now):  # each model's own figures, under its name
            tk, sl, lb = m["tokens"], m["slots"], {"model": str(m["name"])}
            assert isinstance(tk, dict) and isinstance(sl, dict)
            x.metric("mesh_llm_model_tokens_generated_total", "counter", "tokens this model's hosts generated (its "
                     "elected host and replicas, from their gossip)", tk["generated"], lb)  # fmt: skip
            x.metric("mesh_llm_model_tokens_per_second", "gauge", "tokens per second this model's hosts generate now",
                     tk["rate"], lb)  # fmt: skip
            x.metric("mesh_llm_model_slots_busy", "gauge", "this model's hosts' slots running a request", sl["busy"],
                     lb)  # fmt: skip
            x.metric("mesh_llm_model_slots_total", "gauge", "this model's hosts' slots", sl["total"], lb)
            x.metric("mesh_llm_model_serving", "gauge", "1 when this model's host serves", m["state"] == "serving", lb)
        busy, total, queued, ctx = self.slots(now)
        x.metric("mesh_llm_slots_busy", "gauge", "the host's llama-server slots running a request", busy)
        x.metric("mesh_llm_slots_total", "gauge", "the host's llama-server slots (--parallel)", total)
        x.metric("mesh_llm_queue_depth", "gauge", "requests waiting for a slot on the host", queued)
        x.metric("mesh_llm_slot_context_tokens", "gauge", "the context of each slot", ctx)
        x.metric("mesh_llm_elections_total", "counter", "host changes seen", elections)
        x.metric("mesh_llm_build_info", "gauge", "this node's mesh-llm version", 1, {"version": __version__})
        x.metric("mesh_llm_child_restarts_total", "counter", "llama-server deaths (each restarted, or given up on)",
                 self.hosting.crashes)  # fmt: skip
        share = self.hosting.sharing
        for node, n in sorted((share.fetched_now() if share else {}).items()):
            x.metric("mesh_llm_fetch_bytes_total", "counter", "model file bytes this node fetched from each member",
                     n, {"peer": crypto.short(node)})  # fmt: skip
        for node, n in sorted((share.sent if share else {}).items()):
            x.metric("mesh_llm_share_bytes_total", "counter", "model file bytes this node sent to each member that "
                     "fetched it", n, {"peer": crypto.short(node)})  # fmt: skip
        core = self.net.core
        if core is not None:
            for r in core.alive(now):
                if r.node == me:
                    continue
                peer = {"peer": crypto.short(r.node), "name": r.name}
                conn = self.net.peers.get(r.node)
                x.metric("mesh_llm_peer_direct", "gauge", "1 when connected directly, 0 through gossip only",
                         1 if conn else 0, peer)  # fmt: skip
                rtt = core.rtt_ms.get(r.node)
                if rtt is not None:
                    x.metric("mesh_llm_peer_rtt_seconds", "gauge", "round-trip time to the peer", rtt / 1000, peer)
                t = self.hosting.tunnel_counts(r.node)
                for kind in ("rpc", "http"):
                    x.metric("mesh_llm_tunnel_bytes_sent_total", "counter", "tunnel bytes sent to the peer",
                             t[f"{kind}_sent"], {**peer, "kind": kind})  # fmt: skip
                    x.metric("mesh_llm_tunnel_bytes_received_total", "counter", "tunnel bytes received from the peer",
                             t[f"{kind}_received"], {**peer, "kind": kind})  # fmt: skip
        return x.text()


def _fmt(v: float | None) -> float | None:
    return round(v, 3) if v is not None and v != float("inf") else None


def planned_ram_bytes(plan: Plan | Waiting | None, node: NodeId) -> int | None:
    """What the plan keeps in ``node``'s RAM (routed experts, the host's whole layers), None when nothing."""
    if isinstance(plan, Plan):
        return next((a.ram_bytes or None for a in plan.assignments if a.node == node), None)
    return None


def planned_bytes(plan: Plan | Waiting | None, node: NodeId) -> int | None:
    """What the plan puts on ``node`` (weights, KV cache, compute buffers), None when it has no share."""
    if isinstance(plan, Plan):
        return next((a.bytes for a in plan.assignments if a.node == node), None)
    return None


def _same_model(r: PeerRecord, mine: ModelFacts | None) -> bool:
    return r.model is not None and mine is not None and r.model.fingerprint == mine.fingerprint


def layers_of(plan: Plan | Waiting | None, node: NodeId, host: PeerRecord | None = None) -> list[int] | None:
    """``node``'s layers, first and last: as the host's record says its running plan has them (what a lite client,
    which plans nothing, shows too), else as our own plan has them."""
    if host is not None and host.layers and len(host.layers) == len(host.planned):
        for n, (first, count) in zip(host.planned, host.layers, strict=True):
            if n == node:
                return [first, first + count - 1] if count else None
        return None
    if isinstance(plan, Plan):
        for a in plan.assignments:
            if a.node == node:
                return [a.first, a.first + a.count - 1] if a.count else None
    return None


KEY_ENV = "MESH_LLM_API_KEY"  # where the launch lines take the API key from, when the node requires one


def agent_commands(model: str, port: int, ctx: int = 0, keyed: bool = False) -> list[tuple[str, str]]:
    """Launch lines for coding agents, for the model actually served: (what to do, the exact text to paste). ``ctx``:
    the context of each of the host's slots, the window an agent may fill (0: not known yet); ``keyed``: the API
    requires a key, which the lines read from $MESH_LLM_API_KEY (never printed here)."""
    url = f"http://localhost:{port}/v1"
    model_obj: dict[str, object] = {"id": model, **({"contextWindow": ctx} if ctx else {})}
    key = KEY_ENV if keyed else "mesh"  # pi reads an apiKey that names an environment variable from it
    provider = {"mesh": {"baseUrl": url, "api": "openai-completions", "apiKey": key, "models": [model_obj]}}
    goose_key = f"${KEY_ENV}" if keyed else "mesh"
    limit = f"GOOSE_CONTEXT_LIMIT={ctx} " if ctx else ""
    lines = [
        ("pi: add to ~/.pi/agent/models.json", json.dumps({"providers": provider})),
        ("pi: then run", f"pi --provider mesh --model {model}"),
        ("goose: run", f"GOOSE_PROVIDER=openai OPENAI_HOST=http://localhost:{port} OPENAI_API_KEY={goose_key} "
                       f"GOOSE_MODEL={model} {limit}goose session"),
    ]  # fmt: skip
    if keyed:
        lines.insert(0, ("first", f"export {KEY_ENV}=<this node's API key> (the one given with --api-key)"))
    return lines


def agent_lines(model: str, port: int, ctx: int = 0, keyed: bool = False) -> list[str]:
    """The same, as lines for the terminal."""
    return [f"{label}: {text}" for label, text in agent_commands(model, port, ctx, keyed)]
