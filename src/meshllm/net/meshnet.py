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

from meshllm.errors import LocalProtocolError, MeshError, Refused, RemoteProtocolError, UserError
from meshllm.net.endpoint import (
    STREAM_AUTH,
    STREAM_GOSSIP,
    STREAM_KNOCK,
    Addr,
    Conn,
    DialError,
    Endpoint,
    Stream,
    parse_addr,
)  # fmt: skip
from meshllm.net.netevents import CHANGED, Changed, Connected, MeshEvent, NetEvent
from meshllm.net.traversal import Traversal, local_ips
from meshllm.proto import crypto, serving
from meshllm.proto import token as tok
from meshllm.proto.auth import (
    AUTH_MAX_FRAME,
    AuthChallenge,
    AuthHello,
    AuthProof,
    AuthRefuse,
    AuthWelcome,
    Rekey,
    check_proof,
    make_proof,
    pair_token,
    rekey_refused,
)
from meshllm.proto.crypto import NodeId
from meshllm.proto.gossip import PeerRecord, RecordUpdate
from meshllm.proto.knock import REFUSED, KnockAnswer, KnockAsk
from meshllm.proto.meshcore import EventKind, MeshCore, Out, token_alternates
from meshllm.proto.reach import RELAY_RATE, Observed, PunchRequest, RelayMode
from meshllm.proto.wire import FrameDecoder, Message, encode
from meshllm.sockets import host_port
from meshllm.state import (
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

_W = TypeVar("_W", tok.Revocation, tok.Grant, tok.Directive)
log = logging.getLogger("meshllm.mesh")

AUTH_TIMEOUT_S = 5.0
TICK_S = 0.5
GOSSIP_MAX_FRAME = 1 << 20

StreamHandler = Callable[[Conn, Stream], Awaitable[None]]


def local_addresses(port: int, ipv6: bool) -> list[str]:
    """host:port for every address of this machine (IPv6 ones too with ``ipv6``), IPv4 first, loopback last."""
    ips = sorted((ip for ip in local_ips() if ipv6 or ":" not in ip),
                 key=lambda ip: (ip.startswith("127.") or ip == "::1", ":" in ip, ip))  # fmt: skip
    return [host_port(ip, port) for ip in ips] or [f"127.0.0.1:{port}"]


async def _read_frame(stream: Stream, dec: FrameDecoder, timeout: float) -> Message:
    deadline = time.monotonic() + timeout
    while True:
        msgs = dec.feed(b"")
        if msgs:
            return msgs[0]
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        data = await asyncio.wait_for(stream.read(), timeout=left)
        if not data:
            raise ConnectionError("stream closed")
        msgs = dec.feed(data)
        if msgs:
            if len(msgs) > 1:
                raise RemoteProtocolError("unexpected extra frames during auth")
            return msgs[0]


MAX_PREVIOUS_SECRETS = 8  # a member away for this many rotations proves with a secret nobody accepts: re-invite it


class MeshNet:
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
        self.on_knock: Callable[[KnockAsk, str], KnockAnswer] | None = None  # [lan] our doorbell (serve/life/lan.py)
        self.admit_s = admit_s  # how long the admissions we sign hold (--admission)
        self.me = crypto.node_id(key)
        self.m = membership
        self.state_dir = state_dir
        self._revoked_stamp: tuple[int, ...] = ()  # the admins and revoked files as last read (mtimes)
        self._revoked_saved: tuple[int, frozenset[NodeId], frozenset[tok.Directive]] = (0, frozenset(), frozenset())
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
            grants = self._load_signed(ADMINS, lambda o: tok.grant_from_wire(o, mid))
            admins = {g.node for g in grants} | set(table.admins)
            standing = admins - set(table.revoked)
            got = self._load_signed(REVOKED, lambda o: tok.revocation_from_wire(o, mid, standing))
            words = self._load_signed(DIRECTIVES, lambda o: tok.directive_from_wire(o, mid, standing), load_directives)
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
              and tok.cut_off(table.entries[p].record.chain, table.revoked) is None]  # fmt: skip
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

    async def dial_any(self, node: NodeId, addrs: list[str], timeout: float = 3.0) -> Conn:
        """Dial every address at once (a private address of another network would cost a timeout each); the
        first that proves to be ``node`` wins."""
        errors: list[str] = []
        targets: list[Addr] = []
        for a in addrs:
            try:
                t = parse_addr(a)
            except ValueError as e:
                errors.append(str(e))
                continue
            if t not in targets:
                targets.append(t)
        tasks = [asyncio.ensure_future(self.ep.dial(t, node, timeout=timeout)) for t in targets]
        for task in tasks:  # a loser that fails after we stopped listening (shutdown) is not an unretrieved error
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        won: Conn | None = None
        try:
            for fut in asyncio.as_completed(tasks):
                try:
                    won = await fut
                    return won
                except (DialError, OSError) as e:
                    errors.append(str(e))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled() and task.exception() is None and task.result() is not won:
                    task.result().close("another address answered first")
        raise DialError("; ".join(errors) or "no address")

    async def _auth_as_dialler(self, conn: Conn, node: NodeId, token: tok.Token | None) -> list[tok.Link]:
        st = conn.open_stream(STREAM_AUTH)
        dec = FrameDecoder(AUTH_MAX_FRAME)
        assert token is not None or self.m is not None
        mesh_id = token.mesh_id if token else self.m.mesh_id  # type: ignore[union-attr]
        st.write(encode(AuthHello(dialler=self.me, listener=node, mesh_id=mesh_id)))
        ch = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        if not isinstance(ch, AuthChallenge):
            raise RemoteProtocolError("expected a challenge")
        if token is not None:
            proof = make_proof(self.key, token.secret, ch, node, token=token)
        else:
            assert self.m is not None
            proof = make_proof(self.key, self.m.secret, ch, node, chain=self.m.chain)
        st.write(encode(proof))
        ans = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        st.close()
        if isinstance(ans, AuthRefuse):
            if ans.revocation is not None and token is None:
                self._take_refusal_revocation(ans.revocation)
            raise Refused(f"refused by {crypto.short(node)}: {ans.reason}")
        if not isinstance(ans, AuthWelcome):
            raise RemoteProtocolError("expected welcome or refusal")
        chain = tok.chain_from_wire(ans.chain)
        why = tok.verify_chain(chain, self.me, mesh_id, self.wall())
        if why is not None:
            raise RemoteProtocolError(f"welcome with an invalid admission chain: {why}")
        conn.pair_token = pair_token(ch.nonce, self.me, node)
        return chain

    def _take_refusal_revocation(self, obj: object) -> None:
        """A member refused us with the signed revocation that cuts us off (we may have missed its gossip): checked
        like any revocation, taken (so we know we are out), never trusted on the refusal's word alone."""
        if self.core is None:
            return
        table = self.core.table
        try:
            r = tok.revocation_from_wire(obj, self.core.mesh_id, set(table.admins) - set(table.revoked))
        except RemoteProtocolError as e:
            log.warning("a refusal carried a revocation we do not take: %s", e)
            return
        self.send(self.core.revoke([r], self.now))
        self.flush_events()

    async def join(self, token: tok.Token) -> NodeId:
        """Connect to the token's issuer, or another member it names (any member checks a token), whichever answers
        first; as a joiner (token) unless we are already a member of its mesh. The member we joined through."""
        as_member = self.m is not None and self.m.mesh_id == token.mesh_id and self.admitted()
        conn, node = await self._dial_first(token.members())
        try:
            chain = await asyncio.wait_for(
                self._auth_as_dialler(conn, node, None if as_member else token), AUTH_TIMEOUT_S * 2
            )
        except BaseException:
            conn.close("auth failed")
            raise
        if not as_member:
            self.m = Membership(mesh_id=token.mesh_id, secret=token.secret, chain=chain, incarnation=1)
            save_membership(self.state_dir, self.m)
            self._make_core(self.m)
        self._register(conn, node)
        return node

    async def _dial_first(self, members: list[tuple[NodeId, list[str]]]) -> tuple[Conn, NodeId]:
        """Dial every member at once; the first that proves to be who it should be, the others closed."""
        tasks = {asyncio.ensure_future(self.dial_any(n, a)): n for n, a in members}
        errors: list[str] = []
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                won = [t for t in done if t.exception() is None]
                for t in won[1:]:  # two at once: the first is kept
                    t.result().close("another member answered first")
                if won:
                    return won[0].result(), tasks[won[0]]
                errors += [f"{crypto.short(tasks[t])}: {t.exception()}" for t in done]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t in pending:  # cancelled above; one that won a race with the cancel is closed
                t.add_done_callback(_close_unused)
        raise DialError("; ".join(errors) or "no address")

    async def redial(self, members: dict[NodeId, list[str]], timeout: float) -> NodeId | None:
        """Dial the members we knew (a restart: the table is empty), all at once; the first that answered, or None
        when none did within ``timeout``."""
        tasks = [asyncio.ensure_future(self._dial_member(n, a)) for n, a in members.items()
                 if n != self.me and n not in self.peers and n not in self._dialling]  # fmt: skip
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline and not any(n in self.peers for n in members):
            if tasks and all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        return next((n for n in members if n in self.peers), None)

    async def _dial_member(self, node: NodeId, addrs: list[str]) -> None:
        self._dialling.add(node)
        try:
            conn = await self.nat.reach(node, addrs)
            try:
                await asyncio.wait_for(self._auth_as_dialler(conn, node, None), AUTH_TIMEOUT_S * 2)
            except BaseException:
                conn.close("auth failed")
                raise
            self._register(conn, node)
        except (DialError, MeshError, TimeoutError, ConnectionError) as e:
            log.debug("dial %s failed: %s", crypto.short(node), e)
        finally:
            self._dialling.discard(node)

    # ---------------------------------------------------------------- accepting

    async def _on_accept(self, conn: Conn) -> None:
        try:
            st = await asyncio.wait_for(conn.accept(), AUTH_TIMEOUT_S)
            if st is not None and st.kind == STREAM_KNOCK:
                await asyncio.wait_for(self._answer_knock(conn, st), AUTH_TIMEOUT_S)
                return
            if st is None or st.kind != STREAM_AUTH:
                conn.close("first stream was not auth")
                return
            await asyncio.wait_for(self._auth_as_listener(conn, st), AUTH_TIMEOUT_S * 2)
        except (TimeoutError, ConnectionError, RemoteProtocolError) as e:
            if isinstance(e, RemoteProtocolError) or str(e):
                self._refused(conn, None, f"auth did not complete: {e}")
            else:  # [face-3] 4: the other side went away mid-auth (two nodes dialling each other keep one): no refusal
                log.debug("auth from %s ended: %s", host_port(*conn.addr), type(e).__name__)
            conn.close("auth failed")
            return
        if not conn.authenticated:
            return
        self._spawn(self._serve_streams(conn))

    async def _answer_knock(self, conn: Conn, st: Stream) -> None:
        """[lan] A node with no token asks to join (``proto/knock.py``): one answer, then the connection closes;
        it never becomes authenticated. No doorbell here (not announcing): refused."""
        try:
            ask = await _read_frame(st, FrameDecoder(AUTH_MAX_FRAME), AUTH_TIMEOUT_S)
            if not isinstance(ask, KnockAsk):
                raise RemoteProtocolError("expected a knock")
            addr = host_port(*conn.addr)
            no = KnockAnswer(REFUSED, reason="this node takes no knocks")
            ans = self.on_knock(ask, addr) if self.on_knock else no
            st.write(encode(ans))
            st.close()
            await asyncio.sleep(0.05)
        finally:
            conn.close("knock answered")

    async def knock(self, node: NodeId, addrs: list[str], ask: KnockAsk) -> KnockAnswer:
        """[lan] Ask ``node`` (a member announcing its mesh on the LAN) to let us join: its answer."""
        conn = await self.dial_any(node, addrs)
        try:
            st = conn.open_stream(STREAM_KNOCK)
            st.write(encode(ask))
            ans = await _read_frame(st, FrameDecoder(AUTH_MAX_FRAME), AUTH_TIMEOUT_S)
            if not isinstance(ans, KnockAnswer):
                raise RemoteProtocolError("expected an answer to the knock")
            return ans
        finally:
            conn.close("knocked")

    def _refused(self, conn: Conn, who: NodeId | None, reason: str) -> None:
        line = f"refused {crypto.short(who) if who else '?'} from {host_port(*conn.addr)}: {reason}"
        self.refusals.append(line)
        log.warning(line)

    async def _auth_as_listener(self, conn: Conn, st: Stream) -> None:
        dec = FrameDecoder(AUTH_MAX_FRAME)
        hello = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        if not isinstance(hello, AuthHello):
            raise RemoteProtocolError("expected hello")
        nonce = os.urandom(32)
        st.write(encode(AuthChallenge(nonce=nonce)))
        proof = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        if not isinstance(proof, AuthProof):
            raise RemoteProtocolError("expected proof")
        if self.core is None or self.m is None:
            self._refused(conn, hello.dialler, "this node is not in a mesh yet")
            st.write(encode(AuthRefuse(reason="not in a mesh yet")))
            conn.close("refused")
            return
        v = check_proof(
            key=self.key, my_chain=self.m.chain, mesh_id=self.m.mesh_id, secret=self.m.secret, hello=hello,
            nonce=nonce, proof=proof, scope_of=self.core.table.scope_of, chain_of=self.core.table.chain_of,
            revoked=self.core.table.revoked, in_touch=bool(self.peers) or self.m.founder == self.me,
            previous=self.m.previous, now=self.wall(), admit_s=self.admit_s,
        )  # fmt: skip
        if not v.ok:
            self._refused(conn, hello.dialler, v.reason)
            word = self.core.table.revoked.get(v.revoked) if v.revoked else None
            st.write(encode(AuthRefuse(reason=v.reason, revocation=word.to_wire() if word else None)))
            await asyncio.sleep(0.05)
            conn.close("refused")
            return
        assert v.chain is not None
        conn.pair_token = pair_token(nonce, hello.dialler, self.me)
        st.write(encode(AuthWelcome(chain=tok.chain_to_wire(v.chain))))
        st.close()
        if v.joined:
            log.info("admitted %s from %s with a token", crypto.short(hello.dialler), host_port(*conn.addr))
        conn.peer = hello.dialler
        conn.set_authenticated()
        self._register(conn, hello.dialler, listener=True)

    # ---------------------------------------------------------------- connected peers

    def _register(self, conn: Conn, node: NodeId, listener: bool = False) -> None:
        old = self.peers.get(node)
        if old is not None and not old.closed.is_set():
            if serving.keep_existing(old.is_direct, conn.is_direct, old.is_client, self.me, node, conn.is_client):
                conn.close("duplicate connection")
                return
            old.close("duplicate connection")
            self.gossip.pop(node, None)  # its gossip went with it: the new connection's stream takes over
        conn.peer = node
        conn.set_authenticated()
        self.peers[node] = conn
        self.set_link(node, f"relay {crypto.short(conn.relay)}" if conn.relay else "direct")
        self.emit(Connected(node, conn.path))
        if not listener:
            st = conn.open_stream(STREAM_GOSSIP)
            self._start_gossip(conn, node, st)
            self._spawn(self._serve_streams(conn))
        self._spawn(self._watch(conn, node))

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
        return self.m is not None and self.wall() < tok.chain_until(self.m.chain)

    def mint_token(self, ttl_s: float, scope: tok.Scope | None = None) -> tok.Token:
        """An invite token of ``scope`` (default: our own, the widest we may give), naming a few other members a
        joiner dials when we do not answer (the host first, then the biggest)."""
        assert self.m is not None
        recs = self.core.alive(self.now) if self.core is not None else []
        also = token_alternates(recs, self.me, scope if scope is not None else tok.chain_scope(self.m.chain))
        return mint_scoped(self.key, self.m, self.all_addrs, self.wall(), ttl_s, scope, also)


def _close_unused(f: asyncio.Future[Conn]) -> None:
    if not f.cancelled() and f.exception() is None:
        f.result().close("another member answered first")


def mint_scoped(key: Ed25519PrivateKey, m: Membership, addrs: list[str], now: float, ttl_s: float,
                scope: tok.Scope | None, also: list[tuple[NodeId, list[str]]] | None = None,
                node: NodeId | None = None) -> tok.Token:  # fmt: skip
    """A token no wider than our own scope and no longer-lived than the cap (``node``: for that node only), or a
    UserError that says why."""
    mine = tok.chain_scope(m.chain)
    if scope is not None and scope > mine:
        raise UserError(f"this node is {mine}-scoped: it can invite {', '.join(str(s) for s in tok.Scope if s <= mine)}"
                        f" nodes, not {scope} ones")  # fmt: skip
    try:
        return tok.mint(key, m.mesh_id, m.secret, addrs, now, ttl_s, mine if scope is None else scope, also, node)
    except ValueError as e:
        raise UserError(f"cannot mint that token: {e}") from None


def new_mesh(key: Ed25519PrivateKey, now: float) -> Membership:
    """Found a mesh: its id follows from our key, its secret is fresh."""
    chain = tok.found(key, now)
    return Membership(mesh_id=chain[0][0], secret=os.urandom(tok.SECRET_LEN), chain=chain)
