"""Where this node's API sends a request: the decision is ``proto/serving.route``; this gathers its inputs from the
mesh (the models served, the host our own election picks and whether we reach it, why a host that cannot serve
says so: ``proto/standing``) and hands them to ``Hosting.upstream``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from meshllm.llama.supervisor import ChildState
from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto, serving, standing
from meshllm.proto.crypto import NodeId
from meshllm.proto.fleet import Spread
from meshllm.proto.gossip import SUSPECT_AFTER_S
from meshllm.proto.layout import Plan, Waiting
from meshllm.proto.record import ModelFacts, PeerRecord
from meshllm.serve.http.upstream import Unavailable, Upstream
from meshllm.serve.split.hosting import Hosting


class Router:
    def __init__(self, net: MeshNet, hosting: Hosting, me: NodeId, host: Callable[[], NodeId | None],
                 plan: Callable[[], Plan | Waiting | None],
                 facts: Callable[[], ModelFacts | None]) -> None:  # fmt: skip
        """``host``, ``plan``, ``facts``: the node's elected host, its plan and its model, now."""
        self.net, self.hosting, self.me = net, hosting, me
        self.host, self.plan, self.facts = host, plan, facts
        self.spread = Spread()  # which of a model's hosts (elected, replicas) each request goes to

    def models(self) -> list[str]:
        return self.net.core.served_models(time.monotonic()) if self.net.core else []

    def default_model(self) -> str | None:
        """The model a request naming none is for (``serving.default_model``)."""
        facts = self.facts()
        return serving.default_model(self.models(), facts.source if facts else None)

    def serving_hosts(self) -> list[NodeId]:
        """Every host of every model the mesh serves — the one our election picks and its replicas (ourselves left
        out): the tunnels a request may take."""
        core, now = self.net.core, time.monotonic()
        return sorted({r.node for m in self.models() for r in core.hosts_for(m, now)}) if core else []

    def _here(self, model: str | None) -> list[PeerRecord]:
        """Our own record, when our llama-server serves ``model`` (its load as gossip carries it)."""
        srv, facts, core = self.hosting.server, self.facts(), self.net.core
        if core is None or srv is None or srv.state != ChildState.SERVING or facts is None:
            return []
        return [core.record] if model in (None, facts.source) else []

    def route(self, model: str | None) -> Upstream | Unavailable | None:
        core, now = self.net.core, time.monotonic()
        hosts = (core.hosts_for(model, now) if core else []) + self._here(model)
        # a host whose tunnel is still opening gets no request while another is ready (its 503 would be ours)
        ready = [h for h in hosts if h.node == self.me or h.node in self.hosting.door.listeners]
        for h in hosts:
            if h.node != self.me:
                self.hosting.door.open_listener(h.node)
        chosen = self.spread.pick(ready or hosts, now)
        remote = chosen if chosen is not None and chosen.node != self.me else None
        served = (remote.node, remote.model.source if remote.model else "?") if remote else None
        up = self.hosting.upstream(model, self.models(), self.facts(), served, self.plan(), self.host(), self.me,
                                   self.host_says(), here=remote is None)  # fmt: skip
        if not isinstance(up, Upstream):
            return up
        return replace(up, node=remote.node if remote else self.me, spread=self.spread,
                       alive=self._hears(remote.node) if remote else None)  # fmt: skip

    def _hears(self, node: NodeId) -> Callable[[], bool]:
        """Whether the mesh still hears from ``node`` (two heartbeats missed: no longer)."""
        core = self.net.core
        return lambda: core is not None and core.silent_s(node, time.monotonic()) < SUSPECT_AFTER_S

    def host_says(self) -> str:
        """Why the host this node routes to (its own election's, never a self-claim) cannot serve, from its record
        and its silence (``proto/standing.py``): the reason every node gives (503s, /health)."""
        core, now, host = self.net.core, time.monotonic(), self.host()
        rec = core.host_record(now) if core else None
        if core is not None and rec is not None:
            return standing.host_says(rec, core.silent_s(rec.node, now))
        if host is not None and host != self.me:  # declared dead; our election has not moved on yet
            return f"the host {crypto.short(host)} is unreachable: electing another"
        return ""
