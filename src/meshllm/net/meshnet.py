"""The control plane's asyncio shell: QUIC endpoint + auth + MeshCore. It carries bytes and makes no decisions.

Per connection: the dialler opens an auth stream (see proto/auth.py); once the listener accepts, the dialler
opens one gossip stream that both sides use for GossipPush / Ping / Pong frames, and for the reach messages
(proto/reach.py): each side tells the other the address it sees it at (how a node behind a NAT learns its public
address), and members pass hole-punch requests on. Further stream kinds (RPC and HTTP tunnels) go to handlers
registered in ``stream_handlers``.

Reaching members behind NATs is net/traversal.py's job (``self.nat``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar, Unpack

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import LocalProtocolError, RemoteProtocolError, UserError
from meshllm.machine.state import (
    ADMINS,
    DIRECTIVES,
    REVOKED,
    Membership,
    load_directives,
    load_rekey,
    load_signed,
    save_directives,
    save_membership,
    save_signed,
)
from meshllm.net.conn import STREAM_GOSSIP, Addr, Conn, Stream
from meshllm.net.endpoint import Endpoint
from meshllm.net.meshauth import Admitting
from meshllm.net.netevents import CHANGED, Changed, MeshEvent, NetEvent
from meshllm.net.traversal import Traversal, local_ips
from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.auth import (
    Rekey,
    rekey_refused,
)
from meshllm.proto.crypto import NodeId
from meshllm.proto.knock import KnockAnswer, KnockAsk
from meshllm.proto.meshcore import EventKind, MeshCore, Out, token_alternates
from meshllm.proto.reach import RELAY_RATE, Observed, PunchRequest, RelayMode
from meshllm.proto.record import PeerRecord, RecordUpdate
from meshllm.proto.wire import FrameDecoder, encode
from meshllm.sockets import host_port

_W = TypeVar("_W", sgn.Revocation, sgn.Grant, sgn.Directive)
log = logging.getLogger("meshllm.mesh")

TICK_S = 0.5
GOSSIP_MAX_FRAME = 1 << 20

StreamHandler = Callable[[Conn, Stream], Awaitable[None]]


def local_addresses(port: int, ipv6: bool) -> list[str]:
    """host:port for every address of this machine (IPv6 ones too with ``ipv6``), IPv4 first, loopback last."""
    ips = sorted((ip for ip in local_ips() if ipv6 or ":" not in ip),
                 key=lambda ip: (ip.startswith("127.") or ip == "::1", ":" in ip, ip))  # fmt: skip
    return [host_port(ip, port) for ip in ips] or [f"127.0.0.1:{port}"]


MAX_PREVIOUS_SECRETS = 8  # a member away for this many rotations proves with a secret nobody accepts: re-invite it


class MeshNet(Admitting):
    """A node's part in the mesh: its endpoint, its members' connections and gossip, its record; admission (dialling,
    the auth exchange both ways, knocks) in ``net/meshauth.py``."""

    def __init__(
        self,
        key: Ed25519PrivateKey,
        membership: Membership | None,
        state_dir: Path,
        *,
        bind: tuple[str, int] = ("0.0.0.0", 0),
        advertise: list[str] | None = None,
        relay: RelayMode = RelayMode.AUTO,
        relay_hint: str | None = None,
        admit_s: float = tok.ADMIT_S,
        relay_rate: float = RELAY_RATE,
    ) -> None:
        """``relay_rate``: when this node relays, the most it forwards per pair of members, bytes/s (0: no cap)."""
        self.key = key
        self.on_knock: Callable[[KnockAsk, str], KnockAnswer] | None = None  # our doorbell (serve/life/lan.py)
        self.admit_s = admit_s  # how long the admissions we sign hold (--admission)
        self.me = crypto.node_id(key)
        self.m = membership
        self.state_dir = state_dir
        self._revoked_stamp: tuple[int, ...] = ()  # the admins and revoked files as last read (mtimes)
        self._revoked_saved: tuple[int, frozenset[NodeId], frozenset[sgn.Directive]] = (0, frozenset(), frozenset())
        self._rekey_stamp = -1
        self.bind = bind
        self.advertise = advertise
        self.ep = Endpoint(key, on_accept=self._on_accept, on_control=self._on_control)
        self.ep.relay_budget.rate = relay_rate
        self.nat = Traversal(self, relay, relay_hint)
        self.events: asyncio.Queue[NetEvent] = asyncio.Queue()  # for the node's loop (net/netevents.py)
        self._change_queued = False
        self.core: MeshCore | None = None
        self.peers: dict[NodeId, Conn] = {}
        self.gossip: dict[NodeId, Stream] = {}
        self.stream_handlers: dict[int, StreamHandler] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._dialling: set[NodeId] = set()
        self.refusals: list[str] = []
        self._pending_fields: RecordUpdate = {}
        self.addrs: list[str] = []

    # ---------------------------------------------------------------- lifecycle

    @property
    def now(self) -> float:
        """The mesh core's clock: monotonic, so a wall-clock step cannot age records or declare peers dead."""
        return time.monotonic()

    @staticmethod
    def wall() -> float:
        """Wall time, only where a signature carries it: token expiry, admission links."""
        return time.time()

    async def start(self) -> list[str]:
        await self.ep.open(*self.bind)
        host, port = self.ep.local_addr
        if self.advertise:
            self.addrs = self.advertise
        elif host not in ("0.0.0.0", "::"):
            self.addrs = [host_port(host, port)]
        else:
            self.addrs = local_addresses(port, self.ep.ipv6)
        self.ep.relay_server = self.nat.relay_mode == RelayMode.ON
        self._pending_fields["relay"] = self.ep.relay_server
        if self.m is not None:
            self._make_core(self.m)
        self._spawn(self._tick_loop())
        return self.addrs

    @property
    def all_addrs(self) -> list[str]:
        """Our addresses, the ones members see us at first (they are what others can reach)."""
        return self.nat.all_addrs

    def _on_control(self, data: bytes, addr: Addr) -> None:
        self.nat.on_control(data, addr)

    def _make_core(self, m: Membership) -> MeshCore:
        self.core = MeshCore(key=self.key, mesh_id=m.mesh_id, chain=m.chain, incarnation=m.incarnation, now=self.now,
                             admit_s=self.admit_s, wall=self.wall())  # fmt: skip
        first: RecordUpdate = {"addrs": tuple(self.all_addrs), **self._pending_fields}
        self.core.update(self.now, **first)
        return self.core

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, leave: bool = True) -> None:
        if leave and self.core is not None:
            self.send(self.core.leave(self.now))
            await asyncio.sleep(0.3)  # let the leave reach the peers before the connections close
        for t in list(self._tasks):
            t.cancel()
        self.ep.close()

    def record(self, node: NodeId) -> PeerRecord | None:
        """A member's latest gossip record (None: unknown, or we are not in a mesh yet)."""
        e = self.core.table.entries.get(node) if self.core else None
        return e.record if e else None

    def rtt_ms(self, node: NodeId) -> float | None:
        return self.core.rtt_ms.get(node) if self.core else None

    def set_link(self, node: NodeId, how: str) -> None:
        """How we are connected to ``node`` ("direct", "relay <id>"), as our gossip record tells the others."""
        if self.core is not None:
            self.core.links[node] = how

    def update(self, **fields: Unpack[RecordUpdate]) -> None:
        """Change our own gossip record (kept for later if we are not in a mesh yet)."""
        self._pending_fields.update(fields)
        if self.core is not None:
            self.send(self.core.update(self.now, **fields))
        self.emit(CHANGED)

    def emit(self, ev: NetEvent) -> None:
        """Queue ``ev`` for the node's loop; a Changed only when none is waiting (they carry nothing else)."""
        if isinstance(ev, Changed):
            if self._change_queued:
                return
            self._change_queued = True
        self.events.put_nowait(ev)

    def take_change(self) -> None:
        """The node's loop took the queued Changed: the next change queues a new one."""
        self._change_queued = False

    # ---------------------------------------------------------------- sending

    def send(self, out: Out) -> None:
        for peer, msg in out:
            st = self.gossip.get(peer)
            if st is None:
                continue
            try:
                st.write(encode(msg, GOSSIP_MAX_FRAME))
            except ConnectionError as e:
                log.debug("send to %s failed: %s", crypto.short(peer), e)
            except LocalProtocolError:  # our own bug (a frame over the limit): loud, but the mesh goes on
                log.exception("BUG: could not encode %s for %s", type(msg).__name__, crypto.short(peer))

    # ---------------------------------------------------------------- time

    async def _tick_loop(self) -> None:
        while True:
            if self.core is None:
                await asyncio.sleep(TICK_S)
                continue
            now = self.now
            self.send(self.core.tick(now, self.wall()))
            for rec in self.core.wants_to_dial(now):
                if rec.node not in self._dialling:
                    self._spawn(self._dial_member(rec.node, list(rec.addrs)))
            self.nat.try_upgrades()
            self._sync_revocations()
            self._read_rekey_file()
            self.flush_events()
            self.emit(CHANGED)
            await asyncio.sleep(TICK_S)

    def _sync_revocations(self) -> None:
        """The state dir's ``revoked`` and ``admins`` files and the table agree: ``mesh-llm revoke`` / ``mesh-llm
        admin`` write there (the running node takes them within a tick and gossips them); what is heard from peers
        is kept there."""
        assert self.core is not None
        table, mid = self.core.table, self.core.mesh_id
        if self._stamps() != self._revoked_stamp:
            grants = self._load_signed(ADMINS, lambda o: sgn.grant_from_wire(o, mid))
            admins = {g.node for g in grants} | set(table.admins)
            standing = admins - set(table.revoked)
            got = self._load_signed(REVOKED, lambda o: sgn.revocation_from_wire(o, mid, standing))
            words = self._load_signed(DIRECTIVES, lambda o: sgn.directive_from_wire(o, mid, standing), load_directives)
            self.send(self.core.revoke(got, self.now, grants, words))
        saved = (len(table.admins), frozenset(table.revoked), frozenset(table.directives.values()))
        if saved != self._revoked_saved:  # (a revocation may void others: the same count)
            self._revoked_saved = saved
            save_signed(self.state_dir, ADMINS, list(table.admins.values()))
            save_signed(self.state_dir, REVOKED, list(table.revoked.values()))
            save_directives(self.state_dir, list(table.directives.values()))
        self._revoked_stamp = self._stamps()

    def _stamps(self) -> tuple[int, ...]:
        paths = (self.state_dir / ADMINS, self.state_dir / REVOKED, self.state_dir / DIRECTIVES)
        return tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in paths)

    def _load_signed(self, name: str, parse: Callable[[object], _W],
                     load: Callable[[Path], list[list[object]]] | None = None) -> list[_W]:  # fmt: skip
        out = []
        for obj in load(self.state_dir) if load else load_signed(self.state_dir, name):
            try:
                out.append(parse(obj))
            except RemoteProtocolError as e:
                log.warning("%s: an entry refused: %s", self.state_dir / name, e)
        return out

    def _rekey(self) -> Rekey | None:
        """The founder's signed word for our current secret (None before the first rotation)."""
        m = self.m
        if m is None or m.epoch == 0:
            return None
        return Rekey(m.mesh_id, m.epoch, m.secret, m.founder, m.rekey_sig)

    def _take_rekey(self, r: Rekey, source: NodeId | None) -> None:
        """A rotated secret from a member (or ``mesh-llm rotate`` here): keep it if newer, and pass it on."""
        if self.m is None:
            return
        why = rekey_refused(r, self.m.mesh_id)
        if why is not None:
            log.warning("rekey from %s refused: %s", crypto.short(source) if source else "the state dir", why)
            return
        if r.epoch <= self.m.epoch:
            return
        self.m.previous = [self.m.secret, *self.m.previous][:MAX_PREVIOUS_SECRETS]
        self.m.secret, self.m.epoch, self.m.rekey_sig = r.secret, r.epoch, r.sig
        save_membership(self.state_dir, self.m)
        log.info("the mesh's admission secret rotated (epoch %d)", r.epoch)
        # members in good standing only: a node revoked a moment ago may still be connected (its gossip stream open
        # until its connection closes), and a `rotate` right after a `revoke` must not hand it the new secret
        table = self.core.table if self.core else None
        ok = [p for p in self.gossip if p != source and table is not None and table.is_member(p)
              and adm.cut_off(table.entries[p].record.chain, table.revoked) is None]  # fmt: skip
        self.send([(p, r) for p in ok])
        self.emit(MeshEvent(EventKind.REKEYED, self.me, f"epoch {r.epoch}"))

    def _read_rekey_file(self) -> None:
        """``mesh-llm rotate`` leaves the founder's new secret in the state dir's ``rekey``: taken within a tick."""
        path = self.state_dir / "rekey"
        stamp = path.stat().st_mtime_ns if path.exists() else 0
        if stamp == self._rekey_stamp:
            return
        self._rekey_stamp = stamp
        r = load_rekey(self.state_dir)
        if r is not None:
            self._take_rekey(Rekey(*r), None)

    def flush_events(self) -> None:
        if self.core is None:
            return
        for ev in self.core.events:
            if ev.kind == EventKind.RENEWED and self.m is not None:
                self.m.chain = list(self.core.chain)
                save_membership(self.state_dir, self.m)
            if ev.kind in ("died", "left", "revoked", "expired") and ev.node in self.peers:
                self.peers[ev.node].close(f"peer {ev.kind}")  # if it lives, it refutes and reconnects
            self.emit(MeshEvent(ev.kind, ev.node, ev.detail))
        self.core.events.clear()

    # ---------------------------------------------------------------- dialling


    # ---------------------------------------------------------------- accepting


    # ---------------------------------------------------------------- connected peers

    def _start_gossip(self, conn: Conn, node: NodeId, st: Stream) -> None:
        assert self.core is not None
        self.gossip[node] = st
        self.send(self.core.on_connected(node, self.now))
        if conn.relay is None:
            self.send([(node, Observed(addr=host_port(*conn.addr)))])
        rekey = self._rekey()
        if rekey is not None:
            self.send([(node, rekey)])  # a member that was away when the secret rotated learns it here
        self._spawn(self._read_gossip(conn, node, st))

    async def _serve_streams(self, conn: Conn) -> None:
        while True:
            st = await conn.accept()
            if st is None:
                return
            if st.kind == STREAM_GOSSIP and conn.peer is not None and conn.peer not in self.gossip:
                self._start_gossip(conn, conn.peer, st)
            elif st.kind in self.stream_handlers:
                self._spawn(self.stream_handlers[st.kind](conn, st))
            else:
                st.reset()

    async def _read_gossip(self, conn: Conn, node: NodeId, st: Stream) -> None:
        assert self.core is not None
        dec = FrameDecoder(GOSSIP_MAX_FRAME)
        try:
            while True:
                data = await st.read()
                if not data:
                    break
                for msg in dec.feed(data):
                    if isinstance(msg, Observed):
                        self.nat.on_observed(node, conn, msg)
                    elif isinstance(msg, PunchRequest):
                        self.nat.on_punch_request(node, conn, msg)
                    elif isinstance(msg, Rekey):
                        self._take_rekey(msg, node)
                    self.send(self.core.on_message(node, msg, self.now))
                self.flush_events()
        except RemoteProtocolError as e:
            log.warning("closing %s: %s", crypto.short(node), e)
            conn.close("protocol error")

    async def _watch(self, conn: Conn, node: NodeId) -> None:
        await conn.closed.wait()
        if self.peers.get(node) is conn:
            del self.peers[node]
            self.gossip.pop(node, None)
            if self.core is not None:
                self.core.on_disconnected(node, self.now)

    # ---------------------------------------------------------------- tokens

    def admitted(self) -> bool:
        """Whether our admission holds now (it ends unless renewed: token.py)."""
        return self.m is not None and self.wall() < adm.chain_until(self.m.chain)

    def mint_token(self, ttl_s: float, scope: tok.Scope | None = None) -> tok.Token:
        """An invite token of ``scope`` (default: our own, the widest we may give), naming a few other members a
        joiner dials when we do not answer (the host first, then the biggest)."""
        assert self.m is not None
        recs = self.core.alive(self.now) if self.core is not None else []
        also = token_alternates(recs, self.me, scope if scope is not None else adm.chain_scope(self.m.chain))
        return mint_scoped(self.key, self.m, self.all_addrs, self.wall(), ttl_s, scope, also)


def mint_scoped(key: Ed25519PrivateKey, m: Membership, addrs: list[str], now: float, ttl_s: float,
                scope: tok.Scope | None, also: list[tuple[NodeId, list[str]]] | None = None,
                node: NodeId | None = None) -> tok.Token:  # fmt: skip
    """A token no wider than our own scope and no longer-lived than the cap (``node``: for that node only), or a
    UserError that says why."""
    mine = adm.chain_scope(m.chain)
    if scope is not None and scope > mine:
        raise UserError(f"this node is {mine}-scoped: it can invite {', '.join(str(s) for s in tok.Scope if s <= mine)}"
                        f" nodes, not {scope} ones")  # fmt: skip
    try:
        return tok.mint(key, m.mesh_id, m.secret, addrs, now, ttl_s, mine if scope is None else scope, also, node)
    except ValueError as e:
        raise UserError(f"cannot mint that token: {e}") from None


def new_mesh(key: Ed25519PrivateKey, now: float) -> Membership:
    """Found a mesh: its id follows from our key, its secret is fresh."""
    chain = adm.found(key, now)
    return Membership(mesh_id=chain[0][0], secret=os.urandom(tok.SECRET_LEN), chain=chain)
