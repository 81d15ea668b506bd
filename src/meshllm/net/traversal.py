"""NAT traversal for one node (the asyncio shell around proto/reach.py): our public address as members see it,
hole punching coordinated through a member, relays, and moving relayed connections onto punched paths.

Reaching a member (``reach``): dial every advertised address at once; if the peer sits behind a NAT, punch a
hole through both NATs instead, coordinated through a member both sides are connected to; if that fails, dial
through a relay (a member that forwards datagrams). The QUIC connection is end to end in all three cases.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Protocol, Unpack

import psutil

from meshllm.net.conn import Addr, Conn, DialError, Stream
from meshllm.net.endpoint import Endpoint, try_addr
from meshllm.net.netevents import AddrsLearned, Connected, NetEvent
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.meshcore import Out
from meshllm.proto.reach import (
    PROBE_EVERY_S,
    PUNCH_WAIT_S,
    Observed,
    Puncher,
    PunchRequest,
    RelayCandidate,
    RelayMode,
    Send,
    advertised,
    direct_targets,
    observe,
    order_relays,
    punch_targets,
    relayed_addr,
    rendezvous,
)
from meshllm.proto.record import PeerRecord, RecordUpdate
from meshllm.sockets import host_port


class MeshSide(Protocol):
    """What traversal needs of the mesh, and all it sees of it: who we are, our connections, members' records, and
    ways to send, dial and change our record. ``MeshNet`` provides it."""

    me: NodeId
    peers: dict[NodeId, Conn]
    gossip: dict[NodeId, Stream]  # members we exchange gossip with
    ep: Endpoint
    addrs: list[str]  # our configured (not reflexive) addresses

    def record(self, node: NodeId) -> PeerRecord | None: ...
    def rtt_ms(self, node: NodeId) -> float | None: ...
    def set_link(self, node: NodeId, how: str) -> None: ...
    def send(self, out: Out) -> None: ...
    def update(self, **fields: Unpack[RecordUpdate]) -> None: ...
    def emit(self, ev: NetEvent) -> None: ...
    async def dial_any(self, node: NodeId, addrs: list[str], timeout: float = 3.0) -> Conn: ...


log = logging.getLogger("meshllm.mesh")

DIRECT_DIAL_S = 2.0
PUNCH_DIAL_S = 2.0
RELAY_DIAL_S = 4.0
# a relayed connection tries to punch a direct path this often: more than the 30 s a Linux NAT keeps an unanswered
# UDP entry after an attempt's last probe, so a failed attempt's full-TTL probes (which may have made the other
# NAT remap its port) are forgotten before the next one starts with its TTL-2 probes
UPGRADE_EVERY_S = 40.0


def local_ips() -> set[str]:
    """This machine's IP addresses: IPv4, and IPv6 but for link-local ones (fe80::/10 means nothing off its link
    without a zone)."""
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" or (a.family.name == "AF_INET6" and not _link_local(a.address)):
                out.add(a.address)
    return out


def _link_local(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.partition("%")[0]).is_link_local
    except ValueError:
        return True


class Traversal:
    def __init__(self, net: MeshSide, relay_mode: RelayMode = RelayMode.AUTO, relay_hint: str | None = None) -> None:
        self.net = net
        self.relay_mode = relay_mode
        self.relay_hint = relay_hint  # --relay HOST:PORT: the member to relay through, when one is needed
        self.reflexive: list[str] = []  # our address as members see it, newest last
        self.public = False
        self.puncher = Puncher(net.ep.key)
        self._punch_found: dict[NodeId, asyncio.Queue[Addr]] = {}
        self._punch_task: asyncio.Task[None] | None = None
        self._upgrade_tried: dict[NodeId, float] = {}

    async def reach(self, node: NodeId, addrs: list[str]) -> Conn:
        """A connection to a member: direct, else through a punched hole, else through a relay."""
        errors: list[str] = []
        rec = self.net.record(node)
        via = self._rendezvous_for(node)
        direct = direct_targets(addrs, set(rec.reflexive) if rec else set(), bool(via))
        if direct is not None:
            try:
                return await self.net.dial_any(node, direct, DIRECT_DIAL_S)
            except DialError as err:
                errors.append(f"direct: {err}")
        if via:
            try:
                return await self._punch(node, addrs, via)
            except DialError as err:
                errors.append(f"punch: {err}")
        for relay in self._relays_for(node):
            try:
                return await self.net.ep.dial(relayed_addr(relay, node), node, timeout=RELAY_DIAL_S)
            except DialError as err:
                errors.append(f"relay {crypto.short(relay)}: {err}")
        raise DialError("; ".join(errors))

    def _connected_to(self, member: NodeId, node: NodeId) -> bool:
        """Does ``member``'s record say it has a connection to ``node``?"""
        rec = self.net.record(member)
        return rec is not None and node in {*rec.links, *rec.rtt_ms}

    def _rendezvous_for(self, node: NodeId) -> list[NodeId]:
        """Members that can pass a punch request to ``node``: those that say they are connected to it first."""
        others = [p for p in self.net.gossip if p != node]
        return ([p for p in others if self._connected_to(p, node)] or others)[:3]

    def _start_punch(self, node: NodeId, addrs: tuple[str, ...] | list[str], via: list[NodeId]) -> None:
        """Probe ``node`` as the dialler, and ask the members ``via`` to have it probe us."""
        targets = [t for t in (try_addr(a) for a in addrs) if t is not None]
        attempt = self.puncher.start(node, targets, asyncio.get_running_loop().time(), dialler=True)
        req = PunchRequest(src=self.net.me, dst=node, nonce=attempt.nonce, addrs=self.all_addrs[:8])
        self.net.send([(p, req) for p in via])
        self._kick_puncher()

    async def _punch(self, node: NodeId, addrs: list[str], via: list[NodeId]) -> Conn:
        """A punched direct connection, else DialError once no probe came back within PUNCH_WAIT_S: the caller takes
        a relay while the attempt probes on for the rest of its PUNCH_S, and if probes cross after all the relayed
        connection moves onto the punched path (``on_control``) — a relay within seconds where no punch can work,
        a direct path where one does."""
        loop = asyncio.get_running_loop()
        found: asyncio.Queue[Addr] = asyncio.Queue()
        self._punch_found[node] = found
        self._start_punch(node, addrs, via)
        deadline = loop.time() + PUNCH_WAIT_S
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    addr = await asyncio.wait_for(found.get(), left)
                except TimeoutError:
                    break
                try:
                    return await self.net.ep.dial(addr, node, timeout=PUNCH_DIAL_S)
                except DialError as e:
                    log.debug("punched dial to %s failed: %s", addr, e)
            raise DialError(f"no probe came back within {PUNCH_WAIT_S:.0f} s")
        finally:
            self._punch_found.pop(node, None)

    def try_upgrades(self) -> None:
        """Relayed connections we dialled: now and then, try to punch a direct path under them."""
        loop = asyncio.get_running_loop()
        for node, conn in list(self.net.peers.items()):
            rec = self.net.record(node)
            if conn.is_direct or not conn.is_client or rec is None or node in self.puncher.attempts:
                continue
            last = self._upgrade_tried.setdefault(node, loop.time())  # the first try one period after connecting
            if loop.time() - last < UPGRADE_EVERY_S:
                continue
            self._upgrade_tried[node] = loop.time()
            log.info("looking for a direct path to %s under its relayed connection", crypto.short(node))
            self._start_punch(node, rec.addrs, self._rendezvous_for(node))

    def on_punch_request(self, sender: NodeId, conn: Conn, msg: PunchRequest) -> None:
        if msg.dst == self.net.me:
            src = msg.src
            have = self.net.peers.get(src)
            rec = self.net.record(src)
            if (have is not None and have.is_direct) or rec is None:
                return
            targets = [t for t in (try_addr(a) for a in punch_targets(msg.addrs, rec.addrs)) if t is not None]
            self.puncher.start(src, targets, asyncio.get_running_loop().time(), dialler=False, nonce=msg.nonce)
            log.debug("punching towards %s at %s", crypto.short(src), ", ".join(msg.addrs))
            self._kick_puncher()
        elif msg.dst in self.net.gossip:  # we are the rendezvous
            target = self.net.peers.get(msg.dst)
            out = rendezvous(sender, _seen(conn), _seen(target) if target else [], msg)
            self.net.send([(m.dst, m) for m in out])

    def _kick_puncher(self) -> None:
        if self._punch_task is None or self._punch_task.done():
            self._punch_task = asyncio.ensure_future(self._puncher_loop())

    async def _puncher_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.puncher.attempts:
            for s in self.puncher.tick(loop.time()):
                self._send_control(s)
            # connected directly: the attempt is over (a relayed connection's upgrade runs its course instead)
            for node in [n for n in self.puncher.attempts if n in self.net.peers and self.net.peers[n].relay is None]:
                self.puncher.done(node)
            await asyncio.sleep(PROBE_EVERY_S)

    def _send_control(self, s: Send) -> None:
        try:
            self.net.ep.send_control(s.data, s.addr, ttl=s.ttl)
        except OSError as e:
            log.debug("probe to %s: %s", s.addr, e)

    def on_control(self, data: bytes, addr: Addr) -> None:
        h = self.puncher.on_probe(data, addr, asyncio.get_running_loop().time())
        for s in h.sends:
            self._send_control(s)
        if h.peer is None:
            return
        conn = self.net.peers.get(h.peer)
        if h.confirmed is not None and conn is not None and not conn.is_direct:
            conn.go_direct(h.confirmed)  # the relayed connection moves onto the punched path
            self.puncher.quiet(h.peer)
            self.net.set_link(h.peer, "direct")
            self.net.emit(Connected(h.peer, conn.path))
        elif h.dial is not None and h.peer in self._punch_found:
            self._punch_found[h.peer].put_nowait(h.dial)

    def _relays_for(self, node: NodeId) -> list[NodeId]:
        """Members that may relay to ``node``: those we hold a direct connection to, in order_relays order."""
        cands = []
        for p in self.net.gossip:
            rec = self.net.record(p)
            conn = self.net.peers.get(p)
            if rec is None or p == node or conn is None or conn.relay is not None:
                continue
            cands.append(RelayCandidate(p, rec.relay, rec.addrs, self._connected_to(p, node), self.net.rtt_ms(p)))
        return order_relays(cands, self.relay_hint)

    def on_observed(self, sender: NodeId, conn: Conn, msg: Observed) -> None:
        """A member tells us where our packets come from: our public address when we sit behind a NAT."""
        if conn.relay is not None or try_addr(msg.addr) is None:
            return  # a relayed connection says nothing about our address
        reflexive, public = observe(self.reflexive, self.net.addrs, msg.addr, local_ips(), self.net.ep.local_addr[1])
        if public and not self.public and self.relay_mode == RelayMode.AUTO:
            self.public = True
            self.net.ep.relay_server = True
            log.info("reachable without NAT at %s: relaying for members that need it", msg.addr)
            self.net.update(relay=True)
        if reflexive != self.reflexive:
            self.reflexive = reflexive
            log.info("%s sees us at %s", crypto.short(sender), msg.addr)
            self.net.update(addrs=tuple(self.all_addrs), reflexive=tuple(self.reflexive))
            self.net.emit(AddrsLearned(tuple(self.all_addrs)))

    @property
    def all_addrs(self) -> list[str]:
        return advertised(self.reflexive, self.net.addrs, tok.MAX_ADDRS)


def _seen(conn: Conn) -> list[str]:
    """Where a direct connection's packets come from (what a NAT maps the peer to), as a candidate address."""
    return [host_port(*conn.addr)] if conn.relay is None else []
