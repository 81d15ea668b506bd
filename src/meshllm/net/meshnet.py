"""The control plane's asyncio shell: QUIC endpoint + auth + MeshCore. It carries bytes and makes no decisions.

Per connection: the dialler opens an auth stream (see proto/auth.py); once the listener accepts, the dialler
opens one gossip stream that both sides use for GossipPush / Ping / Pong frames, and for the reach messages
(proto/reach.py): each side tells the other the address it sees it at (how a node behind a NAT learns its public
address), and members pass hole-punch requests on. Further stream kinds (RPC and HTTP tunnels) go to handlers
registered in ``stream_handlers``.

Reaching a member (``_reach``): dial every advertised address at once; if none answers, punch a hole through
both NATs, coordinated through a member both sides are connected to; if that fails too, dial through a relay
(a member that forwards datagrams). The QUIC connection is end to end in all three cases.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import MeshError, RemoteProtocolError, UserError
from meshllm.net.endpoint import STREAM_AUTH, STREAM_GOSSIP, Addr, Conn, DialError, Endpoint, Stream
from meshllm.proto import crypto, reach
from meshllm.proto import token as tok
from meshllm.proto.auth import (
    AUTH_MAX_FRAME,
    AuthChallenge,
    AuthHello,
    AuthProof,
    AuthRefuse,
    AuthWelcome,
    check_proof,
    make_proof,
)
from meshllm.proto.crypto import NodeId
from meshllm.proto.meshcore import MeshCore, Out
from meshllm.proto.reach import Observed, Puncher, PunchRequest
from meshllm.proto.wire import FrameDecoder, Message, encode
from meshllm.state import Membership, save_membership

log = logging.getLogger("meshllm.mesh")

AUTH_TIMEOUT_S = 5.0
TICK_S = 0.5
GOSSIP_MAX_FRAME = 1 << 20
DIRECT_DIAL_S = 2.0
# a relayed connection tries to punch a direct path this often: more than the 30 s a Linux NAT keeps an unanswered
# UDP entry after an attempt's last probe, so a failed attempt's full-TTL probes (which may have made the other
# NAT remap its port) are forgotten before the next one starts with its TTL-2 probes
UPGRADE_EVERY_S = 40.0
PUNCH_DIAL_S = 2.0
RELAY_DIAL_S = 4.0

StreamHandler = Callable[[Conn, Stream], Awaitable[None]]


def local_addresses(port: int) -> list[str]:
    """host:port for every IPv4 address of this machine, loopback last."""
    ips: list[str] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and a.address not in ips:
                ips.append(a.address)
    ips.sort(key=lambda ip: (ip.startswith("127."), ip))
    return [f"{ip}:{port}" for ip in ips] or [f"127.0.0.1:{port}"]


def local_ips() -> set[str]:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family.name == "AF_INET"}


def parse_addr(text: str) -> Addr:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {text!r}")
    return host.strip("[]"), int(port)


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


class MeshNet:
    def __init__(
        self,
        key: Ed25519PrivateKey,
        membership: Membership | None,
        state_dir: Path,
        *,
        bind: tuple[str, int] = ("0.0.0.0", 0),
        advertise: list[str] | None = None,
        on_event: Callable[[str, NodeId, str], None] | None = None,
        relay: str = "auto",
        relay_hint: str | None = None,
    ) -> None:
        self.key = key
        self.me = crypto.node_id(key)
        self.m = membership
        self.state_dir = state_dir
        self.bind = bind
        self.advertise = advertise
        self.ep = Endpoint(key, on_accept=self._on_accept, on_control=self._on_control)
        self.relay_mode = relay  # auto (relay when publicly reachable) | on (--relay-server) | off
        self.relay_hint = relay_hint  # --relay HOST:PORT: the member to relay through, when one is needed
        self.reflexive: list[str] = []  # our address as members see it, newest last
        self.public = False
        self.on_addrs: Callable[[list[str]], None] = lambda addrs: None
        self.on_connect: Callable[[NodeId, str], None] = lambda node, path: None
        self.puncher = Puncher(self.me)
        self._punch_found: dict[NodeId, asyncio.Queue[Addr]] = {}
        self._punch_task: asyncio.Task[None] | None = None
        self._upgrade_tried: dict[NodeId, float] = {}
        self.core: MeshCore | None = None
        self.peers: dict[NodeId, Conn] = {}
        self._gossip: dict[NodeId, Stream] = {}
        self.stream_handlers: dict[int, StreamHandler] = {}
        self.on_event = on_event or (lambda kind, node, detail: None)
        self.on_change: Callable[[], None] = lambda: None
        self._tasks: set[asyncio.Task[None]] = set()
        self._dialling: set[NodeId] = set()
        self.refusals: list[str] = []
        self._pending_fields: dict[str, object] = {}
        self.addrs: list[str] = []

    # ---------------------------------------------------------------- lifecycle

    @property
    def now(self) -> float:
        return time.time()

    async def start(self) -> list[str]:
        await self.ep.open(*self.bind)
        host, port = self.ep.local_addr
        if self.advertise:
            self.addrs = self.advertise
        elif host not in ("0.0.0.0", "::"):
            self.addrs = [f"{host}:{port}"]
        else:
            self.addrs = local_addresses(port)
        self.ep.relay_server = self.relay_mode == "on"
        self._pending_fields["relay"] = self.ep.relay_server
        if self.m is not None:
            self._make_core(self.m)
        self._spawn(self._tick_loop())
        return self.addrs

    def _make_core(self, m: Membership) -> MeshCore:
        self.core = MeshCore(key=self.key, mesh_id=m.mesh_id, chain=m.chain, incarnation=m.incarnation, now=self.now)
        self.core.update(self.now, **{"addrs": tuple(self.all_addrs), **self._pending_fields})
        return self.core

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, leave: bool = True) -> None:
        if leave and self.core is not None:
            self._send(self.core.leave(self.now))
            await asyncio.sleep(0.3)  # let the leave reach the peers before the connections close
        for t in list(self._tasks):
            t.cancel()
        self.ep.close()

    def update(self, **fields: object) -> None:
        """Change our own gossip record (kept for later if we are not in a mesh yet)."""
        self._pending_fields.update(fields)
        if self.core is not None:
            self._send(self.core.update(self.now, **fields))
        self.on_change()

    # ---------------------------------------------------------------- sending

    def _send(self, out: Out) -> None:
        for peer, msg in out:
            st = self._gossip.get(peer)
            if st is None:
                continue
            try:
                st.write(encode(msg, GOSSIP_MAX_FRAME))
            except (ConnectionError, MeshError) as e:
                log.debug("send to %s failed: %s", crypto.short(peer), e)

    # ---------------------------------------------------------------- time

    async def _tick_loop(self) -> None:
        while True:
            if self.core is None:
                await asyncio.sleep(TICK_S)
                continue
            now = self.now
            self._send(self.core.tick(now))
            for rec in self.core.wants_to_dial(now):
                if rec.node not in self._dialling:
                    self._spawn(self._dial_member(rec.node, list(rec.addrs)))
            self._try_upgrades()
            self.flush_events()
            self.on_change()
            await asyncio.sleep(TICK_S)

    def flush_events(self) -> None:
        if self.core is None:
            return
        for ev in self.core.events:
            if ev.kind in ("died", "left") and ev.node in self.peers:
                self.peers[ev.node].close(f"peer {ev.kind}")  # if it lives, it refutes and reconnects
            self.on_event(ev.kind, ev.node, ev.detail)
        self.core.events.clear()

    # ---------------------------------------------------------------- dialling

    async def _dial_any(self, node: NodeId, addrs: list[str], timeout: float = 3.0) -> Conn:
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

    async def _reach(self, node: NodeId, addrs: list[str]) -> Conn:
        """A connection to a member: direct, else through a punched hole, else through a relay."""
        errors: list[str] = []
        e = self.core.table.entries.get(node) if self.core else None
        nat = set(e.record.reflexive) if e else set()
        # a NATed peer's public address gets no full-TTL packet before the punch: arriving before the peer has
        # sent anything, it would make the peer's NAT remap its port for good (DESIGN.md)
        # (its private addresses are among the punch's targets: a peer on our LAN answers those probes)
        via = self._rendezvous_for(node)
        if not (nat and via):
            try:
                return await self._dial_any(node, [a for a in addrs if not (via and a in nat)], DIRECT_DIAL_S)
            except DialError as err:
                errors.append(f"direct: {err}")
        if via:
            try:
                return await self._punch(node, addrs, via)
            except DialError as err:
                errors.append(f"punch: {err}")
        for relay in self._relays_for(node):
            try:
                return await self.ep.dial(reach.relayed_addr(relay, node), node, timeout=RELAY_DIAL_S)
            except DialError as err:
                errors.append(f"relay {crypto.short(relay)}: {err}")
        raise DialError("; ".join(errors))

    # ---------------------------------------------------------------- hole punching and relays

    def _connected_to(self, member: NodeId, node: NodeId) -> bool:
        """Does ``member``'s record say it has a connection to ``node``?"""
        e = self.core.table.entries.get(member) if self.core else None
        return e is not None and crypto.short(node) in {*e.record.links, *e.record.rtt_ms}

    def _rendezvous_for(self, node: NodeId) -> list[NodeId]:
        """Members that can pass a punch request to ``node``: those that say they are connected to it first."""
        others = [p for p in self._gossip if p != node]
        return ([p for p in others if self._connected_to(p, node)] or others)[:3]

    async def _punch(self, node: NodeId, addrs: list[str], via: list[NodeId]) -> Conn:
        targets = [t for t in (_try_addr(a) for a in addrs) if t is not None]
        loop = asyncio.get_running_loop()
        attempt = self.puncher.start(node, targets, loop.time(), dialler=True)
        found: asyncio.Queue[Addr] = asyncio.Queue()
        self._punch_found[node] = found
        req = PunchRequest(src=self.me, dst=node, nonce=attempt.nonce, addrs=self.all_addrs[:8])
        self._send([(p, req) for p in via])
        self._kick_puncher()
        deadline = loop.time() + reach.PUNCH_S
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    addr = await asyncio.wait_for(found.get(), left)
                except TimeoutError:
                    break
                try:
                    return await self.ep.dial(addr, node, timeout=PUNCH_DIAL_S)
                except DialError as e:
                    log.debug("punched dial to %s failed: %s", addr, e)
            raise DialError(f"no probe came back within {reach.PUNCH_S:.0f} s")
        finally:
            self.puncher.done(node)
            self._punch_found.pop(node, None)

    def _try_upgrades(self) -> None:
        """Relayed connections we dialled: now and then, try to punch a direct path under them."""
        loop = asyncio.get_running_loop()
        for node, conn in list(self.peers.items()):
            e = self.core.table.entries.get(node) if self.core else None
            if conn.is_direct or not conn.is_client or e is None or node in self.puncher.attempts:
                continue
            last = self._upgrade_tried.setdefault(node, loop.time())  # the first try one period after connecting
            if loop.time() - last < UPGRADE_EVERY_S:
                continue
            self._upgrade_tried[node] = loop.time()
            log.info("looking for a direct path to %s under its relayed connection", crypto.short(node))
            targets = [t for t in (_try_addr(a) for a in e.record.addrs) if t is not None]
            attempt = self.puncher.start(node, targets, loop.time(), dialler=True)
            req = PunchRequest(src=self.me, dst=node, nonce=attempt.nonce, addrs=self.all_addrs[:8])
            self._send([(p, req) for p in self._rendezvous_for(node)])
            self._kick_puncher()

    def _on_punch_request(self, sender: NodeId, conn: Conn, msg: PunchRequest) -> None:
        if msg.dst == self.me:
            src = msg.src
            have = self.peers.get(src)
            if (have is not None and have.is_direct) or self.core is None or src not in self.core.table.entries:
                return
            targets = [t for t in (_try_addr(a) for a in msg.addrs) if t is not None]
            self.puncher.start(src, targets, asyncio.get_running_loop().time(), dialler=False, nonce=msg.nonce)
            log.debug("punching towards %s at %s", crypto.short(src), ", ".join(msg.addrs))
            self._kick_puncher()
        elif msg.dst in self._gossip and msg.dst != sender and len(msg.nonce) == reach.NONCE_LEN:
            # we are the rendezvous: vouch for who asks, and add the address we see them at
            seen = [f"{conn.addr[0]}:{conn.addr[1]}"] if conn.relay is None else []
            fwd = PunchRequest(src=sender, dst=msg.dst, nonce=msg.nonce, addrs=[*seen, *msg.addrs][:8])
            self._send([(msg.dst, fwd)])

    def _kick_puncher(self) -> None:
        if self._punch_task is None or self._punch_task.done():
            self._punch_task = asyncio.ensure_future(self._puncher_loop())

    async def _puncher_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.puncher.attempts:
            for s in self.puncher.tick(loop.time()):
                self._send_control(s)
            # connected directly: the attempt is over (a relayed connection's upgrade runs its course instead)
            for node in [n for n in self.puncher.attempts if n in self.peers and self.peers[n].relay is None]:
                self.puncher.done(node)
            await asyncio.sleep(reach.PROBE_EVERY_S)

    def _send_control(self, s: reach.Send) -> None:
        try:
            self.ep.send_control(s.data, s.addr, ttl=s.ttl)
        except OSError as e:
            log.debug("probe to %s: %s", s.addr, e)

    def _on_control(self, data: bytes, addr: Addr) -> None:
        h = self.puncher.on_probe(data, addr, asyncio.get_running_loop().time())
        for s in h.sends:
            self._send_control(s)
        if h.peer is None:
            return
        conn = self.peers.get(h.peer)
        if h.confirmed is not None and conn is not None and not conn.is_direct:
            conn.go_direct(h.confirmed)  # the relayed connection moves onto the punched path
            self.puncher.quiet(h.peer)
            if self.core is not None:
                self.core.links[h.peer] = "direct"
            self.on_connect(h.peer, conn.path)
        elif h.dial is not None and h.peer in self._punch_found:
            self._punch_found[h.peer].put_nowait(h.dial)

    def _relays_for(self, node: NodeId) -> list[NodeId]:
        """Members that may relay to ``node``: those we hold a direct connection to, in reach.order_relays order."""
        if self.core is None:
            return []
        cands = []
        for p in self._gossip:
            e = self.core.table.entries.get(p)
            conn = self.peers.get(p)
            if e is None or p == node or conn is None or conn.relay is not None:
                continue
            cands.append(reach.RelayCandidate(p, e.record.relay, e.record.addrs, self._connected_to(p, node),
                                              self.core.rtt_ms.get(p)))  # fmt: skip
        return reach.order_relays(cands, self.relay_hint)

    def _on_observed(self, sender: NodeId, conn: Conn, msg: Observed) -> None:
        """A member tells us where our packets come from: our public address when we sit behind a NAT."""
        try:
            host, port = parse_addr(msg.addr)
        except ValueError:
            return
        if conn.relay is not None:
            return  # a relayed connection says nothing about our address
        public = host in local_ips() and port == self.ep.local_addr[1]
        if public and not self.public and self.relay_mode == "auto":
            self.public = True
            self.ep.relay_server = True
            log.info("reachable without NAT at %s: relaying for members that need it", msg.addr)
            self.update(relay=True)
        if msg.addr in self.addrs or msg.addr in self.reflexive:
            return
        self.reflexive = [*self.reflexive, msg.addr][-2:]
        log.info("%s sees us at %s", crypto.short(sender), msg.addr)
        self._set_addrs()

    def _set_addrs(self) -> None:
        self.update(addrs=tuple(self.all_addrs), reflexive=tuple(self.reflexive))
        self.on_addrs(self.all_addrs)

    @property
    def all_addrs(self) -> list[str]:
        """Every address we know for ourselves, the ones members saw first (they are what others can reach)."""
        return [*self.reflexive[::-1], *(a for a in self.addrs if a not in self.reflexive)][: tok.MAX_ADDRS]

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
            raise UserError(f"refused by {crypto.short(node)}: {ans.reason}")
        if not isinstance(ans, AuthWelcome):
            raise RemoteProtocolError("expected welcome or refusal")
        chain = tok.chain_from_wire(ans.chain)
        why = tok.verify_chain(chain, self.me, mesh_id)
        if why is not None:
            raise RemoteProtocolError(f"welcome with an invalid admission chain: {why}")
        return chain

    async def join(self, token: tok.Token) -> None:
        """Connect to the token's issuer; as a joiner (token) unless we are already a member of its mesh."""
        as_member = self.m is not None and self.m.mesh_id == token.mesh_id
        conn = await self._dial_any(token.issuer, list(token.addrs))
        try:
            chain = await asyncio.wait_for(
                self._auth_as_dialler(conn, token.issuer, None if as_member else token), AUTH_TIMEOUT_S * 2
            )
        except BaseException:
            conn.close("auth failed")
            raise
        if not as_member:
            self.m = Membership(mesh_id=token.mesh_id, secret=token.secret, chain=chain, incarnation=1)
            save_membership(self.state_dir, self.m)
            self._make_core(self.m)
        self._register(conn, token.issuer)

    async def _dial_member(self, node: NodeId, addrs: list[str]) -> None:
        self._dialling.add(node)
        try:
            conn = await self._reach(node, addrs)
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
            if st is None or st.kind != STREAM_AUTH:
                conn.close("first stream was not auth")
                return
            await asyncio.wait_for(self._auth_as_listener(conn, st), AUTH_TIMEOUT_S * 2)
        except (TimeoutError, ConnectionError, RemoteProtocolError) as e:
            self._refused(conn, None, f"auth did not complete: {e or type(e).__name__}")
            conn.close("auth failed")
            return
        if not conn.authenticated:
            return
        self._spawn(self._serve_streams(conn))

    def _refused(self, conn: Conn, who: NodeId | None, reason: str) -> None:
        line = f"refused {crypto.short(who) if who else '?'} from {conn.addr[0]}:{conn.addr[1]}: {reason}"
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
            nonce=nonce, proof=proof, is_member=self.core.table.is_member, now=self.now,
        )  # fmt: skip
        if not v.ok:
            self._refused(conn, hello.dialler, v.reason)
            st.write(encode(AuthRefuse(reason=v.reason)))
            await asyncio.sleep(0.05)
            conn.close("refused")
            return
        assert v.chain is not None
        st.write(encode(AuthWelcome(chain=tok.chain_to_wire(v.chain))))
        st.close()
        if v.joined:
            log.info("admitted %s from %s:%d with a token", crypto.short(hello.dialler), *conn.addr)
        conn.peer = hello.dialler
        conn.set_authenticated()
        self._register(conn, hello.dialler, listener=True)

    # ---------------------------------------------------------------- connected peers

    def _register(self, conn: Conn, node: NodeId, listener: bool = False) -> None:
        old = self.peers.get(node)
        if old is not None and not old.closed.is_set():
            # two connections for one pair: keep a direct one over a relayed one, else the one dialled by the
            # smaller NodeId (both sides decide alike)
            if old.is_direct != conn.is_direct:
                keep_old = old.is_direct
            else:
                keep_old = (old.is_client and self.me < node) or (not old.is_client and node < self.me)
            if keep_old:
                conn.close("duplicate connection")
                return
            old.close("duplicate connection")
        conn.peer = node
        conn.set_authenticated()
        self.peers[node] = conn
        if self.core is not None:
            self.core.links[node] = f"relay {crypto.short(conn.relay)}" if conn.relay else "direct"
        self.on_connect(node, conn.path)
        if not listener:
            st = conn.open_stream(STREAM_GOSSIP)
            self._start_gossip(conn, node, st)
            self._spawn(self._serve_streams(conn))
        self._spawn(self._watch(conn, node))

    def _start_gossip(self, conn: Conn, node: NodeId, st: Stream) -> None:
        assert self.core is not None
        self._gossip[node] = st
        self._send(self.core.on_connected(node, self.now))
        if conn.relay is None:
            self._send([(node, Observed(addr=f"{conn.addr[0]}:{conn.addr[1]}"))])
        self._spawn(self._read_gossip(conn, node, st))

    async def _serve_streams(self, conn: Conn) -> None:
        while True:
            st = await conn.accept()
            if st is None:
                return
            if st.kind == STREAM_GOSSIP and conn.peer is not None and conn.peer not in self._gossip:
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
                        self._on_observed(node, conn, msg)
                    elif isinstance(msg, PunchRequest):
                        self._on_punch_request(node, conn, msg)
                    self._send(self.core.on_message(node, msg, self.now))
                self.flush_events()
        except RemoteProtocolError as e:
            log.warning("closing %s: %s", crypto.short(node), e)
            conn.close("protocol error")

    async def _watch(self, conn: Conn, node: NodeId) -> None:
        await conn.closed.wait()
        if self.peers.get(node) is conn:
            del self.peers[node]
            self._gossip.pop(node, None)
            if self.core is not None:
                self.core.on_disconnected(node, self.now)

    # ---------------------------------------------------------------- tokens

    def mint_token(self, ttl_s: float) -> tok.Token:
        assert self.m is not None
        return tok.mint(self.key, self.m.mesh_id, self.m.secret, self.all_addrs, self.now, ttl_s)


def _try_addr(text: str) -> Addr | None:
    try:
        return parse_addr(text)
    except ValueError:
        return None


def new_mesh(key: Ed25519PrivateKey, now: float) -> Membership:
    """Found a mesh: its id follows from our key, its secret is fresh."""
    chain = tok.found(key, now)
    return Membership(mesh_id=chain[0][0], secret=os.urandom(tok.SECRET_LEN), chain=chain)
