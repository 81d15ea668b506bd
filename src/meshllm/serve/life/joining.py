"""Joining a mesh and inviting others: the first token that works, the invite token this node prints (kept out of
logs), and — for a node that joined without --model — the mesh's model found on this machine by fingerprint."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from rich.console import Console

from meshllm.errors import MeshError, UserError
from meshllm.llama.chat import chat_default
from meshllm.llama.gguf import is_embedding_model, read_header
from meshllm.machine.state import (
    has_node,
    load_addrs,
    load_ledger,
    load_members,
    load_membership,
    load_or_create_key,
    load_token,
    save_addrs,
    save_members,
    save_token,
)
from meshllm.net.meshnet import MeshNet, mint_scoped
from meshllm.paths import models_dir
from meshllm.proto import admission as adm
from meshllm.proto import crypto, fleet, ledger
from meshllm.proto import token as tok
from meshllm.proto.capacity import Offer
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import GB, ModelShape
from meshllm.proto.record import ModelFacts, Role
from meshllm.serve.fetch.fetching import LayerKeeper, obtain_and_open, obtain_model
from meshllm.serve.fetch.modelfiles import ModelFiles, find_by_fingerprint, model_shape
from meshllm.serve.life import lan
from meshllm.serve.options import NodeOptions, default_name
from meshllm.serve.report.narration import duration
from meshllm.serve.split.hosting import Hosting


async def join_first(net: MeshNet, tokens: list[tok.Token], console: Console) -> None:
    """Join through the first token whose issuer answers; one line naming every failure otherwise."""
    errors = []
    for t in tokens:
        try:
            via = await net.join(t)
            console.print(f"joined mesh [bold]{t.mesh_id.hex()[:8]}[/] via {crypto.short(via)}"
                          + ("" if via == t.issuer else f" (the token's issuer {crypto.short(t.issuer)} did not "
                                                        "answer first)"))  # fmt: skip
            return
        except (MeshError, TimeoutError, OSError) as e:
            errors.append(f"{crypto.short(t.issuer)}: {e}")
    raise UserError("could not join: " + "; ".join(errors))


async def enter_mesh(net: MeshNet, tokens: list[tok.Token], state: Path, o: NodeOptions, lite: bool,
                     members: Members, console: Console) -> list[asyncio.Future[None]]:  # fmt: skip
    """Join through a token (``--join-lan``: the one an approval brings), or (a restart, or a member's --join with a
    token of its own mesh) rejoin the members this node knew and the token names before it plans alone; then say
    what its scope lets it do and publish its invite token; the founder or an admin announces the mesh on the LAN.
    The tasks that keep dialling the remembered members and announcing."""
    if not tokens and net.m is None and o.join_lan is not None:
        tokens = [await lan.join_lan(net, o.join_lan, o.name or default_name(), console)]
    ours = net.m is not None and all(t.mesh_id == net.m.mesh_id for t in tokens)
    if tokens and not ours:
        await join_first(net, tokens, console)
    for t in tokens:  # the token's issuer and the members it names: remembered, and dialled below when ours
        members.remember(t.members())
    if ours:
        await rejoin(net, members.ledger.ordered(), console)
    tasks: list[asyncio.Future[None]] = [asyncio.ensure_future(members.keep_dialling())]
    assert net.m is not None and net.core is not None
    scope = adm.chain_scope(net.m.chain)
    if scope < tok.Scope.HOST and not lite:
        what = {tok.Scope.WORKER: "serves layers for a host-scoped member and is never elected host",
                tok.Scope.CLIENT: "may use the API only: it serves no layers"}  # fmt: skip
        console.print(f"scope {scope}: this node {what[scope]}")
    publish_token(net, state, o.token_ttl_s, console)
    if o.announce:  # the founder and admins (also one named later) announce the mesh on the LAN
        tasks.append(asyncio.ensure_future(lan.keep_announcing(net, state, o.name or default_name(), console)))
    return tasks


async def rejoin(net: MeshNet, known: list[tuple[NodeId, list[str]]], console: Console) -> None:
    """A restart (or a member's --join with a token of its own mesh): dial every member this node knew. One line
    either way; with none answering, what it does and what to do (it keeps dialling them: the mesh heals when one
    comes back)."""
    if not known:
        return
    got = await net.redial(dict(known), ledger.REDIAL_S)
    if got is not None:
        console.print(f"rejoined the mesh via {crypto.short(got)} (a member this node knew)")
        return
    where = ", ".join(list(dict.fromkeys(a[0] for _, a in known))[:4])
    console.print(f"[yellow]none of the {len(known)} members this node knew answered ({where}); it serves alone "
                  f"and dials them every {ledger.REDIAL_S:.0f} s — to join another mesh, start it with --join TOKEN[/]")


class Members:
    """The members this node remembers (``proto/ledger.py``), kept in its state dir: a restart dials them all, and a
    running node keeps dialling the ones it has no word of, so two parts of one mesh that came up apart merge."""

    def __init__(self, net: MeshNet, state: Path) -> None:
        self.net, self.state = net, state
        self.ledger = load_ledger(state, net.me, time.time())
        self._live: frozenset[NodeId] = frozenset()

    def remember(self, members: list[tuple[NodeId, list[str]]]) -> None:
        """Members named to us (by a token): into the ledger, saved now."""
        if any([self.ledger.see(n, addrs, self.net.wall()) for n, addrs in members]):
            save_members(self.state, self.ledger)

    def note(self, now: float, ttl_s: float) -> None:
        """The live members (clients aside: nobody dials a client) into the ledger, saved when it changed; the
        saved invite token re-minted when the live members changed (it names some: a joiner dials them when this
        node is away)."""
        core = self.net.core
        if core is None:
            return
        wall, stale = self.net.wall(), False
        live = [r for r in core.alive(now) if r.node != self.net.me and r.addrs and r.role != Role.CLIENT]
        for r in live:
            stale |= self.ledger.see(r.node, r.addrs, wall)
        if stale:
            save_members(self.state, self.ledger)
        ids = frozenset(r.node for r in live)
        if ids != self._live and ids:
            self._live = ids
            if self.net.m is not None and load_token(self.state) is not None:
                save_token(self.state, self.net.mint_token(ttl_s).encode())

    async def keep_dialling(self) -> None:
        """Every REDIAL_S: dial the remembered members we have no word of (not connected, not in the gossip
        table, whose own dialling covers those), each on the ledger's schedule."""
        while True:
            await asyncio.sleep(ledger.REDIAL_S)
            core = self.net.core
            now = self.net.now
            present = set(self.net.peers)
            if core is not None:
                present |= {r.node for r in core.alive(now)} | set(core.table.graveyard) | set(core.table.revoked)
            self.net.dial_members(self.ledger.to_dial(present, now))


def publish_token(net: MeshNet, state: Path, ttl_s: float, console: Console) -> None:
    """Mint an invite token into the state dir; print it only to a terminal (a file or a pipe may be a log)."""
    t = net.mint_token(ttl_s)
    path = save_token(state, t.encode())
    if sys.stdout.isatty():
        console.print(f"invite token ({t.scope} scope, valid {duration(ttl_s)}, also in {path}):")
        print(t.encode(), flush=True)
    else:
        console.print(
            f"invite token ({t.scope} scope) written to {path} (mode 0600); `mesh-llm token` prints a new one"
        )


def mint_invite(state: Path, ttl_s: float, scope: tok.Scope | None) -> tuple[str, str]:
    """``mesh-llm token``: a new invite token from the node's state dir, naming the members it last knew (a joiner
    dials them too); one of the node's own scope replaces the saved invite, a narrower one is only returned. The
    line that says what it is, and the token."""
    if not has_node(state):
        raise UserError(f"no node in {state}: start one with `mesh-llm --model ...` first (or pass --state-dir)")
    m = load_membership(state)
    if m is None:
        raise UserError(f"the node in {state} is not in a mesh yet")
    also = load_members(state)
    t = mint_scoped(load_or_create_key(state), m, load_addrs(state), time.time(), ttl_s, scope, also)
    saved = ""
    if scope is None or scope == adm.chain_scope(m.chain):
        saved = f"; it replaces the invite saved in {save_token(state, t.encode())}"
    return f"{t.scope} token, valid {duration(ttl_s)}{saved}:", t.encode()


def addresses_learned(net: MeshNet, state: Path, addrs: list[str], ttl_s: float, console: Console) -> None:
    """Members told us our public addresses: recorded, and the invite token re-minted so that it carries them."""
    save_addrs(state, addrs)
    console.print(f"addresses as members see them: {', '.join(addrs[:3])}", markup=False)  # "[v6]:port"
    if net.m is not None and load_token(state) is not None:
        save_token(state, net.mint_token(ttl_s).encode())


def mesh_groups(net: MeshNet, now: float) -> list[fleet.ModelGroup]:
    """The models the mesh serves (not dropped ones), each with its host and nodes, from the live records."""
    core = net.core
    if core is None:
        return []
    recs = [r for r in core.table.alive(now) if r.model is None or not core.table.dropped(r.model.source)]
    return fleet.model_groups(recs, lambda r: core.host_of(r, now))


def mesh_model(net: MeshNet, now: float) -> ModelFacts | None:
    """The model a node joining without one serves: the one that needs it most (``proto/fleet.neediest``: waiting
    for memory, then the busiest), from the live records."""
    g = fleet.neediest(mesh_groups(net, now))
    return g.host.model if g is not None and g.host is not None else None


async def find_mesh_model(net: MeshNet, where_opt: Path | None, can_serve: bool, fetch: bool,
                          console: Console) -> tuple[ModelFacts, Path | None] | None:  # fmt: skip
    """Joined without --model (or with --model auto: ``fetch``): the model that needs this node most and its copy
    on this machine, by fingerprint (any file name; None: none here, to fetch), or None with a line saying why this
    node stays a lite client (``can_serve``: we have llama.cpp binaries)."""
    facts = None
    for _ in range(40):
        if (facts := mesh_model(net, time.monotonic())) is not None:
            break
        await asyncio.sleep(0.25)
    if facts is None:
        then = "serving nothing until it does (or `mesh-llm serve NAME`)" if fetch else "staying a lite client"
        console.print(f"[yellow]the mesh serves no model yet: {then}[/]")
        return None
    where = models_dir(where_opt)
    found = await asyncio.to_thread(find_by_fingerprint, where, facts.fingerprint, facts.size)
    if found is None and not fetch:
        console.print(
            f"[yellow]no copy of {facts.source} ({facts.size / GB:.2f} GB, fingerprint {facts.fingerprint[:12]}) in "
            f"{where}: staying a lite client (start it with --model auto, or --model NAME, to fetch it from the "
            "members that have it)[/]"
        )
        return None
    if not can_serve:
        console.print("[yellow]found the model but no llama.cpp binaries: staying a lite client[/]")
        return None
    if found is not None:
        console.print(f"found the mesh's model {facts.source} as {found} (same fingerprint): joining as a worker")
    else:
        console.print(f"--model auto: the model that needs this node most is {facts.source}: fetching it")
    return facts, found


async def adopt_model(net: MeshNet, hosting: Hosting, wanted: str | None, o: NodeOptions, offer: Offer,
                      console: Console, wait_s: float = 30.0
                      ) -> tuple[ModelFiles, ModelShape, LayerKeeper | None] | None:  # fmt: skip
    """Joined without --model (the model that needs us most, if this machine has a copy; with --model auto, fetched
    if not), or with one this machine lacks (``wanted``: fetched from the members that have it — only our layers,
    unless --fetch all — else the hub): our
    rpc-server on it, and we say in our record that we serve it as a worker (and which layers a partial copy holds).
    None: this node stays a lite client."""
    keeper = None
    found = await find_mesh_model(net, o.models_dir, o.bins is not None, o.auto_fetch, console) if not wanted else None
    if wanted is None and found is None:
        return None
    if found is not None and found[1] is not None:  # a copy here
        hdr = read_header(found[1])
        embedding = is_embedding_model(hdr.metadata)
        model = ModelFiles(found[1], found[0], chat=chat_default(hdr.metadata), embedding=embedding)
        shape = model_shape(hdr)
    else:  # fetched (its layers) from the members that serve it; --model auto: the model that needs us most
        name = wanted or found[0].fingerprint if found is not None else wanted
        assert name is not None
        model, shape, copy = await obtain_and_open(net, name, o, console, hosting.sharing, wait_s)
        if copy is not None:
            keeper = LayerKeeper(copy, net, lambda line: console.print(line, markup=False), hosting.sharing)
    await hosting.start_rpc_server(model, offer.served)
    net.update(role=Role.WORKER, capacity=offer.capacity, model=model.facts,
               held=keeper.copy.held() if keeper is not None else None)  # fmt: skip
    return model, shape, keeper


async def download_through_mesh(tokens: list[str], name: str, where: Path | None, console: Console) -> Path:
    """``mesh-llm download NAME --join TOKEN``: a throwaway lite member (its own key and state, gone afterwards)
    joins, fetches the model from the members that serve it (the hub if none does), and leaves."""
    import tempfile

    from meshllm.serve.options import parse_tokens

    checked = parse_tokens(tokens, time.time(), None)
    with tempfile.TemporaryDirectory(prefix="mesh-llm-download-") as tmp:
        state = Path(tmp)
        state.chmod(0o700)
        net = MeshNet(crypto.new_key(), None, state)
        try:
            await net.start()
            await join_first(net, checked, console)
            net.update(role=Role.CLIENT, name="download")
            return await obtain_model(net, name, where, console)
        finally:
            await net.stop(leave=True)
