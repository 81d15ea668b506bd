"""A mesh found on the LAN, joined only with approval. The founder (or an admin) announces its mesh with
mDNS/DNS-SD (``zeroconf``): the mesh id, its own node id and short id, its name and its mesh addresses — public
facts, never a secret. ``mesh-llm --join-lan`` browses for announcements, then knocks at the announcing member
(``proto/knock.py``) until someone there runs ``mesh-llm approve NODE``: the knock's answer then carries an invite
token of the scope chosen, and the node joins with it as with ``--join``. Until then nothing is admitted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from zeroconf import Error as ZeroconfError
from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from meshllm.errors import MeshError, UserError
from meshllm.machine.state import (
    load_addrs,
    load_approvals,
    load_knocks,
    load_members,
    load_membership,
    load_or_create_key,
    load_refusals,
    save_approvals,
    save_knocks,
    save_refusals,
)  # fmt: skip
from meshllm.net.endpoint import parse_addr
from meshllm.net.meshnet import MeshNet, mint_scoped
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.knock import APPROVED, REFUSED, Doorbell, KnockAnswer, KnockAsk, make_knock, refusal_is_final

log = logging.getLogger("meshllm.lan")

SERVICE = "_mesh-llm._udp.local."
BROWSE_S = 2.0  # one look for announcements
FIND_S = 15.0  # --join-lan looks this long before it says no mesh announces itself
KNOCK_EVERY_S = 2.0  # a waiting node knocks again this often (the approval reaches it at its next knock)
APPROVAL_TTL_S = 600.0  # the token an approval makes lives this long: the node it names joins at its next knock


@dataclass(frozen=True)
class LanMesh:
    """One announcement: a member of a mesh that takes knocks."""

    mesh_id: bytes
    node: NodeId
    name: str
    addrs: tuple[str, ...]

    def describe(self) -> str:
        return f"mesh {self.mesh_id.hex()[:8]} (announced by {crypto.short(self.node)} \"{self.name}\")"


def _lan_addrs(addrs: list[str]) -> list[tuple[str, int]]:
    parsed = [parse_addr(a) for a in addrs]
    v4 = [(h, p) for h, p in parsed if ":" not in h]
    return [(h, p) for h, p in v4 if not h.startswith("127.")] or v4


async def announce(net: MeshNet, name: str) -> None:
    """Announce our mesh on the LAN until cancelled (then withdrawn)."""
    assert net.m is not None
    addrs = _lan_addrs(net.all_addrs)
    if not addrs:
        return
    short = crypto.short(net.me)
    info = AsyncServiceInfo(
        SERVICE, f"{short}.{SERVICE}", port=addrs[0][1], addresses=[socket.inet_aton(h) for h, _ in addrs],
        server=f"mesh-llm-{short}.local.",
        properties={"v": "1", "mesh": net.m.mesh_id.hex(), "node": net.me.hex(), "name": name[:63]},
    )  # fmt: skip
    try:
        zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    except (OSError, ZeroconfError) as e:
        log.warning("cannot announce the mesh on the LAN (mDNS): %s; --join TOKEN still works", e)
        return
    try:
        await zc.async_register_service(info)
        await asyncio.Event().wait()
    except (OSError, ZeroconfError) as e:
        log.warning("cannot announce the mesh on the LAN (mDNS): %s; --join TOKEN still works", e)
    finally:
        try:
            await asyncio.wait_for(zc.async_unregister_service(info), 2.0)
        except (TimeoutError, OSError, ZeroconfError) as e:
            log.debug("withdrawing the announcement: %s", e)
        await zc.async_close()


def _parse(info: AsyncServiceInfo) -> LanMesh | None:
    props = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
    try:
        mesh, node = bytes.fromhex(props["mesh"]), bytes.fromhex(props["node"])
    except (KeyError, ValueError):
        return None
    if props.get("v") != "1" or len(node) != crypto.NODE_ID_LEN or not info.port:
        return None
    addrs = tuple(f"{ip}:{info.port}" for ip in info.parsed_addresses(IPVersion.V4Only))
    return LanMesh(mesh, node, props.get("name", "?")[:63], addrs) if addrs else None


async def browse(wait_s: float = BROWSE_S) -> list[LanMesh]:
    """The announcements heard within ``wait_s``."""
    try:
        zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    except (OSError, ZeroconfError) as e:
        raise UserError(f"cannot look for meshes on the LAN (mDNS): {e}; join with --join TOKEN instead") from None
    names: set[str] = set()

    def heard(**kw: Any) -> None:
        if kw["state_change"] in (ServiceStateChange.Added, ServiceStateChange.Updated):
            names.add(kw["name"])

    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE], handlers=[heard])
    found: list[LanMesh] = []
    try:
        await asyncio.sleep(wait_s)
        for n in sorted(names):
            info = AsyncServiceInfo(SERVICE, n)
            if await info.async_request(zc.zeroconf, 2000) and (m := _parse(info)) is not None:
                found.append(m)
    finally:
        await browser.async_cancel()
        await zc.async_close()
    return found


def _matches(m: LanMesh, pick: str) -> bool:
    p = pick.lower()
    return not p or m.mesh_id.hex().startswith(p) or m.node.hex().startswith(p) or m.name.lower() == p


async def join_lan(net: MeshNet, pick: str, name: str, console: Console) -> tok.Token:
    """``--join-lan [MESH]``: find the mesh on the LAN, knock until approved; the token the approval carries."""
    loop = asyncio.get_running_loop()
    deadline, found = loop.time() + FIND_S, list[LanMesh]()
    while not found:
        found = [m for m in await browse() if _matches(m, pick)]
        if not found and loop.time() > deadline:
            what = f"matching {pick!r} " if pick else ""
            raise UserError(f"no mesh {what}announces itself on this LAN (its founder runs with --no-announce, or "
                            "mDNS does not cross this network): join with a token — `mesh-llm token` on a member, "
                            "then --join TOKEN")  # fmt: skip
    if len({m.mesh_id for m in found}) > 1:
        raise UserError("several meshes announce themselves here: " + "; ".join(m.describe() for m in found)
                        + " — name one: --join-lan MESH (its id, or the announcing node's id or name)")  # fmt: skip
    said, why, ignored, mesh = False, "", list[str](), found[0].mesh_id
    while True:
        answered = False
        for m in list(found):  # every member that announces the mesh, each round: one that answers "waiting" and
            # never approves (anyone can announce) must not keep our knocks from the founder
            ask = make_knock(net.key, mesh, name, time.time(), m.node)
            try:
                ans = await net.knock(m.node, list(m.addrs), ask)
            except (MeshError, TimeoutError, OSError) as e:
                why = str(e)
                continue
            answered = True
            if ans.state == APPROVED:
                try:
                    t = tok.check(tok.parse(ans.token), time.time(), m.mesh_id)
                except tok.TokenError as e:
                    raise UserError(f"the approval of {m.describe()} carried a token we cannot use: {e}") from None
                if t.node not in (None, net.me):
                    log.warning("%s answered with a token for another node: ignored", m.describe())
                    continue
                return t
            if ans.state == REFUSED:
                if refusal_is_final(ans, m.mesh_id, m.node):
                    raise UserError(f"{m.describe()} refused us: {ans.reason}")
                found.remove(m)  # not the founder, not an admin: its word ends nothing
                ignored.append(f"{m.describe()}: {ans.reason}")
                console.print(f"{m.describe()} refused us ({ans.reason[:100]}), but it is neither the mesh's "
                              "founder nor an admin: still asking the others", markup=False)  # fmt: skip
                continue
            if not said:
                console.print(f"asked to join {m.describe()} as {crypto.short(net.me)} \"{name}\"; waiting for "
                              f"approval — on that node: [bold]mesh-llm approve {crypto.short(net.me)}[/] "
                              "(--scope worker, host or client)")  # fmt: skip
                said = True
        if not answered:
            log.debug("no announcing member answered a knock: %s", why)
        # between rounds, look again (as long as a round's pause): a member that announces the mesh later, or that
        # the first look missed, the founder among them, is asked from the next round on; before, a node that first
        # heard only an announcer that never approves knocked there alone for ever
        known = {m.node for m in found}
        found += [m for m in await browse(KNOCK_EVERY_S) if _matches(m, pick) and m.mesh_id == mesh
                  and m.node not in known and not any(m.describe() in line for line in ignored)]  # fmt: skip
        if not found and loop.time() > deadline + FIND_S:
            raise UserError("no member that may let us in answered: " + "; ".join(ignored))


ANNOUNCE_CHECK_S = 2.0  # how often a node checks whether it is the founder or an admin (one named while it runs)


def takes_knocks(net: MeshNet) -> bool:
    """The founder and the admins announce the mesh and answer knocks; nobody else."""
    return net.m is not None and net.core is not None and (
        net.m.founder == net.me or net.me in net.core.table.admins)  # fmt: skip


async def keep_announcing(net: MeshNet, state: Path, name: str, console: Console) -> None:
    """Announce the mesh and answer knocks while this node is the founder or an admin (checked every
    ANNOUNCE_CHECK_S: an admin named while it runs starts, one whose rights end stops); until cancelled."""
    task: asyncio.Future[None] | None = None
    try:
        while True:
            on = takes_knocks(net)
            if on and task is None:
                open_doorbell(net, state, console)
                task = asyncio.ensure_future(announce(net, name))
            elif not on and task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                task, net.on_knock = None, None
            await asyncio.sleep(ANNOUNCE_CHECK_S)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def open_doorbell(net: MeshNet, state: Path, console: Console) -> None:
    """Answer knocks (``proto/knock.py``): list them in the state dir's ``knocks`` (``mesh-llm approve`` shows
    them) and hand an approved node the token ``mesh-llm approve`` left for it in ``approvals``."""
    assert net.m is not None
    bell = Doorbell(net.m.mesh_id, net.me, {})
    listed: list[dict[str, object]] = []

    def on_knock(ask: KnockAsk, addr: str) -> KnockAnswer:
        assert net.core is not None
        table = net.core.table
        new = ask.node not in bell.waiting
        ans = bell.ring(ask, addr, time.time(), load_approvals(state), set(table.entries) | set(table.revoked),
                        load_refusals(state))  # fmt: skip
        grant = table.admins.get(net.me)
        if ans.state == REFUSED and grant is not None:  # an admin's refusal is final: the founder's word says so
            ans = replace(ans, grant=grant.to_wire())
        rows = [{"node": k.node.hex(), "name": k.name, "addr": k.addr, "first": k.first}
                for k in bell.waiting.values()]  # fmt: skip
        rows += [{"node": k.node.hex(), "name": k.name, "addr": k.addr, "first": k.first, "evicted": True}
                 for k in reversed(bell.gone.values())]  # fmt: skip  # `approve NODE` still finds them
        if rows != listed:  # a knock repeated every 2 s changes nothing to list
            save_knocks(state, rows)
            listed[:] = rows
        who = f"{crypto.short(ask.node)} \"{ask.name}\" at {addr}"
        if ans.state == APPROVED:
            console.print(f"lan: {who} was approved: it joins now")
        elif ans.state == REFUSED:
            log.warning("refused a knock from %s: %s", who, ans.reason)
        elif new:
            console.print(f"lan: {who} asks to join this mesh: [bold]mesh-llm approve {crypto.short(ask.node)}[/] "
                          "(--scope worker, host or client) lets it in")  # fmt: skip
        return ans

    net.on_knock = on_knock


def _waiting(state: Path, node: str) -> dict[str, object]:
    """The knock listed in ``state`` that ``node`` (4 or more hex digits) names (a knock the list evicted lately
    too: a flood of others must not hide it); one line when none or several."""
    text = node.strip().lower()
    rows = load_knocks(state)
    match = [r for r in rows if str(r.get("node", "")).startswith(text)] if len(text) >= 4 else []
    if len(match) > 1:  # the same node listed and remembered: one
        match = [r for r in match if not r.get("evicted")] or match[:1]
    if len(match) != 1:
        raise UserError(f"{node!r} names no single node that waits for approval here: `mesh-llm approve` lists them")
    return match[0]


def refuse(state: Path, node: str) -> str:
    """``mesh-llm refuse NODE``: its next knock is answered "refused" (it stops asking and says so)."""
    who = _waiting(state, node)
    refused = load_refusals(state)
    refused.add(bytes.fromhex(str(who["node"])))
    save_refusals(state, refused)
    return f"refused {str(who['node'])[:8]} \"{who.get('name')}\": its next knock is told so, and it stops asking"


def approve(state: Path, node: str | None, scope: tok.Scope, ttl_s: float = APPROVAL_TTL_S) -> str:
    """``mesh-llm approve [NODE]``: the line to print — the knocks waiting (no NODE), or the approval made: a token
    of ``scope`` for that node, which the running node hands it at its next knock."""
    if not node:
        rows = [r for r in load_knocks(state) if not r.get("evicted")]
        if not rows:
            return "no node waits for approval (a node asks with `mesh-llm --join-lan`)"
        return "\n".join(f"{str(r.get('node', ''))[:8]}  \"{r.get('name')}\" from {r.get('addr')}" for r in rows)
    m = load_membership(state)
    if m is None:
        raise UserError(f"the node in {state} is not in a mesh yet")
    row = _waiting(state, node)
    who = bytes.fromhex(str(row["node"]))
    t = mint_scoped(load_or_create_key(state), m, load_addrs(state), time.time(), ttl_s, scope,
                    load_members(state), node=who)  # fmt: skip
    approvals = load_approvals(state)
    approvals[who] = t.encode()
    save_approvals(state, approvals)
    return (f"approved {crypto.short(who)} \"{row.get('name')}\" as a {scope} member: it joins at its next knock "
            f"(within {KNOCK_EVERY_S:.0f} s; the approval lasts {ttl_s / 60:.0f} min)")
