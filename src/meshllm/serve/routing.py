"""Where this node's API sends a request: the decision is ``proto/serving.route``; this gathers its inputs from the
mesh (the models served, the host our own election picks and whether we reach it, why a host that cannot serve
says so: ``proto/standing``) and hands them to ``Hosting.upstream``."""

from __future__ import annotations

import time
from collections.abc import Callable

from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto, standing
from meshllm.proto.crypto import NodeId
from meshllm.proto.gossip import ModelFacts
from meshllm.proto.planner import Plan, Waiting
from meshllm.serve.api import Unavailable, Upstream
from meshllm.serve.hosting import Hosting


class Router:
    def __init__(self, net: MeshNet, hosting: Hosting, me: NodeId, host: Callable[[], NodeId | None],
                 plan: Callable[[], Plan | Waiting | None],
                 facts: Callable[[], ModelFacts | None]) -> None:  # fmt: skip
        """``host``, ``plan``, ``facts``: the node's elected host, its plan and its model, now."""
        self.net, self.hosting, self.me = net, hosting, me
        self.host, self.plan, self.facts = host, plan, facts

    def models(self) -> list[str]:
        return self.net.core.served_models(time.monotonic()) if self.net.core else []

    def serving_hosts(self) -> list[NodeId]:
        """The host of every model the mesh serves, as our election picks them (ourselves left out)."""
        hosts = [self.serving_host(m) for m in self.models()]
        return sorted({h for h in hosts if h is not None and h != self.me})

    def serving_host(self, model: str | None) -> NodeId | None:
        core = self.net.core
        return core.serving_host(model, time.monotonic()) if core else None

    def route(self, model: str | None) -> Upstream | Unavailable | None:
        remote = self.serving_host(model)
        core = self.net.core
        rec = (core.record if remote == self.me else self.net.record(remote)) if remote and core else None
        name = rec.model.source if rec and rec.model else "?"
        served = (remote, name) if remote else None
        return self.hosting.upstream(model, self.models(), self.facts(), served, self.plan(), self.host(), self.me,
                                     self.host_says())  # fmt: skip

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
