"""A node started with ``--model auto`` that serves nothing (the mesh had no model for it when it joined, or its
model was dropped: it lets it go) takes one up as soon as the mesh has one: a model the founder or an admin asked
the mesh to serve that no node holds (``mesh-llm serve NAME``: fetched from the catalog or the hub), else the model
that needs it most (``proto/fleet``: the same choice as at start-up). The decision is ``fleet.asked_for``; this
shell runs it."""

from __future__ import annotations

import asyncio
import logging

from rich.console import Console

from meshllm.errors import MeshError, UserError
from meshllm.net.meshnet import MeshNet
from meshllm.net.netevents import CHANGED
from meshllm.proto import fleet
from meshllm.proto.capacity import Offer
from meshllm.proto.layout import ModelShape
from meshllm.proto.record import ModelFacts, Role
from meshllm.serve.fetch.fetching import LayerKeeper
from meshllm.serve.fetch.modelfiles import ModelFiles
from meshllm.serve.life.joining import adopt_model, mesh_groups
from meshllm.serve.options import NodeOptions
from meshllm.serve.split.hosting import Hosting

log = logging.getLogger("meshllm.adoption")
Adopted = tuple[ModelFiles | None, ModelShape | None, LayerKeeper | None]  # (None, None, None): let go
RETRY_S = 60.0  # a model that could not be fetched is tried again after this long


class Adoption:
    def __init__(self, net: MeshNet, hosting: Hosting, o: NodeOptions, offer: Offer, console: Console) -> None:
        self.net, self.hosting, self.o, self.offer, self.console = net, hosting, o, offer, console
        self._task: asyncio.Task[Adopted | None] | None = None
        self._failed: dict[str | None, float] = {}  # a name (None: the neediest model) and when its adoption failed

    def step(self, now: float, model: ModelFacts | None) -> Adopted | None:
        """At a mesh change: the model this node took up or let go of (once), else take one up if it serves
        nothing and the mesh has one for it, or let its model go if it was dropped."""
        core, task = self.net.core, self._task
        if task is not None and task.done():
            self._task = None
            return task.result()
        if not self.o.auto_model or self.o.bins is None or core is None or task is not None:
            return None
        if model is not None:
            if core.table.dropped(model.source):
                self._task = asyncio.ensure_future(self._let_go(f"{model.source} was dropped"))
            elif (g := fleet.move_to(core.record, mesh_groups(self.net, now))) is not None:
                self._task = asyncio.ensure_future(self._let_go(f"{g.name} waits for memory and {model.source} does "
                                                                "not use this node"))  # fmt: skip
            return None
        served = core.served_models(now)
        words = [(d.model, d.serve, d.at) for name in core.table.directives if (d := core.table.directive(name))]
        failed = {n for n, t in self._failed.items() if now - t < RETRY_S}  # tried a moment ago
        name = fleet.asked_for(words, {*served, *(n for n in failed if n)})
        if (name is None and not served) or name in failed:
            return None
        self._task = asyncio.ensure_future(self._adopt(name, now))
        return None

    async def _let_go(self, why: str) -> Adopted:
        self.console.print(f"{why}: this node (--model auto) lets its model go and serves what the mesh needs")
        await self.hosting.release_model()
        self.net.update(role=Role.CLIENT, capacity=0, model=None, replica=False, planned=(), layers=(), held=None,
                        why="")  # fmt: skip
        self.net.emit(CHANGED)
        return None, None, None

    async def _adopt(self, name: str | None, now: float) -> Adopted | None:
        if name is not None:
            self.console.print(f"the mesh was asked to serve {name} and no node holds it: this node takes it up")
        try:
            got = await adopt_model(self.net, self.hosting, name, self.o, self.offer, self.console, wait_s=1.0)
        except (UserError, MeshError, OSError) as e:
            self.console.print(f"cannot serve {name or 'the mesh model'}: {e} (trying again in {RETRY_S:.0f} s)",
                               style="red", markup=False)  # fmt: skip
            got = None
        if got is None:
            self._failed[name] = now
        self.net.emit(CHANGED)  # the next change takes the model up (step)
        return got
