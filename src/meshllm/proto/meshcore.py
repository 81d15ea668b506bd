"""One node's mesh logic without I/O: gossip, liveness, heartbeats, RTT, election.

The asyncio shell (and the in-memory simulator in the tests) tells it what happened — a peer connected, a
message arrived, time passed — and sends what it returns. It never reads a clock or a socket: every entry takes
``now``. Outgoing messages are ``(peer, message)`` pairs; ``events`` collects what the shell may print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Unpack

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import RemoteProtocolError
from meshllm.proto import admission as adm
from meshllm.proto import crypto, serving
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.election import DEBOUNCE_S, Candidate, Debouncer, elect
from meshllm.proto.gossip import (
    HEARTBEAT_S,
    GossipPush,
    Liveness,
    MergeResult,
    Ping,
    Pong,
    Renewal,
    RenewAsk,
    Table,
    Tombstone,
)
from meshllm.proto.record import NodeState, PeerRecord, RecordUpdate, Role
from meshllm.proto.serving import designated_dialler
from meshllm.proto.token import Scope
from meshllm.proto.wire import Message

Out = list[tuple[NodeId, Message]]
DIAL_RETRY_S = 3.0
# the other side of a pair dials too once they have been apart this long: the designated dialler may be unable to
# (a public node cannot dial into a NAT, and with nobody left to coordinate a punch it would never reconnect)
DIAL_FALLBACK_S = 8.0
# a directly connected peer answers our pings every HEARTBEAT_S: silence this long means it is gone (faster than
# waiting for its record to age out; a false alarm costs the peer one refutation)
DIRECT_DEAD_S = 6.0
RENEW_RETRY_S = 10.0  # a renewal asked for and not given: ask again (maybe another peer) after this long


class EventKind(StrEnum):
    JOINED = "joined"
    LEFT = "left"  # a clean leave
    DIED = "died"  # declared dead after silence
    HOST = "host"  # a new host elected
    REFUTED = "refuted"  # we were declared dead and came back as a new incarnation
    REVOKED = "revoked"  # cut off by the founder (the node itself, or one admitted through it); ourselves too
    REKEYED = "rekeyed"  # the founder rotated the admission secret (detail: the epoch); this node has the new one
    RENEWED = "renewed"  # our admission was renewed by a peer (node: the renewer; detail: until when, unix s)
    EXPIRED = "expired"  # a member's admission ended without renewal (ours too): it is out
    DIRECTIVE = "directive"  # the founder or an admin (node) said to serve or drop a model (detail: "drop NAME")


@dataclass(frozen=True)
class Event:
    kind: EventKind
    node: NodeId
    detail: str = ""


@dataclass
class MeshCore:
    key: Ed25519PrivateKey
    mesh_id: bytes
    chain: list[adm.Link]
    incarnation: int
    now: float
    admit_s: float = tok.ADMIT_S  # how long the admissions we sign (renewals, token joins) hold
    me: NodeId = field(init=False)
    table: Table = field(init=False)
    record: PeerRecord = field(init=False)
    peers: set[NodeId] = field(default_factory=set)  # connected, authenticated
    rtt_ms: dict[NodeId, float] = field(default_factory=dict)
    links: dict[NodeId, str] = field(default_factory=dict)  # how each connected peer is reached (the shell says)
    events: list[Event] = field(default_factory=list)
    _election: Debouncer[NodeId] = field(default_factory=lambda: Debouncer[NodeId](DEBOUNCE_S))
    _last_beat: float = 0.0
    _dialled: dict[NodeId, float] = field(default_factory=dict)
    _apart: dict[NodeId, float] = field(default_factory=dict)  # known, not connected, since
    _heard: dict[NodeId, float] = field(default_factory=dict)  # last message from each connected peer
    _raw_self: bytes = b""
    wall: float | None = None  # wall time as of the last tick (admissions end at wall times); None: not told yet
    _renew_asked: float = -1e18
    _expired_told: bool = False
    _out: bool = False  # we were revoked (or cut off with the node that admitted us)
    known_models: dict[str, None] = field(default_factory=dict)  # every name seen served (``serving.answer_as``)

    def __post_init__(self) -> None:
        self.me = crypto.node_id(self.key)
        self.table = Table(self.me, self.mesh_id)
        self.record = PeerRecord(node=self.me, incarnation=self.incarnation, seq=0, chain=tuple(self.chain))
        self.table.my_incarnation = self.incarnation
        self.table.wall = self.wall
        self._sign()
        self._last_beat = self.now

    # ---------------------------------------------------------------- own record

    def _sign(self) -> None:
        if self.wall is not None:
            self.record = dataclasses.replace(self.record, at=int(self.wall))
        self.table.my_links = frozenset(self.record.links) | frozenset(self.peers)
        self._raw_self = self.record.to_wire(self.key)

    def update(self, now: float, **fields: Unpack[RecordUpdate]) -> Out:
        """Change our own record (role, state, model, ...) and tell every peer."""
        if "role" in fields:
            fields["role"] = Role(fields["role"])  # a bad value is our bug: ValueError, loud
        if "state" in fields:
            fields["state"] = NodeState(fields["state"])
        self.record = dataclasses.replace(self.record, seq=self.record.seq + 1, **fields)
        self._sign()
        self._last_beat = now
        return self._to_all(GossipPush(records=[self._raw_self]))

    def leave(self, now: float) -> Out:
        """A clean leave: our signed tombstone, to every peer."""
        return self.update(now, left=True, state=NodeState.LEAVING)

    # ---------------------------------------------------------------- connections

    def on_connected(self, peer: NodeId, now: float) -> Out:
        self.peers.add(peer)
        self.table.my_links = self.table.my_links | {peer}  # it may declare us dead from now on (a false death)
        self._heard[peer] = now
        full = self.table.push_all()
        return [(peer, dataclasses.replace(full, records=[self._raw_self, *full.records]))]

    def on_disconnected(self, peer: NodeId, now: float) -> None:
        self.peers.discard(peer)
        self.rtt_ms.pop(peer, None)
        self.links.pop(peer, None)
        self._heard.pop(peer, None)

    def on_message(self, peer: NodeId, msg: Message, now: float) -> Out:
        self._heard[peer] = now
        if isinstance(msg, Ping):
            return [(peer, Pong(t=msg.t))]
        if isinstance(msg, Pong):
            if 0 <= now - msg.t < 60:
                self.rtt_ms[peer] = (now - msg.t) * 1000.0
            return []
        if isinstance(msg, GossipPush):
            before = set(self.table.entries)
            res = self.table.merge_push(msg, now)
            return self._after_merge(res, before, exclude=peer, now=now)
        if isinstance(msg, RenewAsk):
            return self._renew_for(peer)
        if isinstance(msg, Renewal):
            return self._take_renewal(peer, msg, now)
        return []

    # ---------------------------------------------------------------- admission renewal

    def _renew_for(self, peer: NodeId) -> Out:
        """A peer asks us to renew its admission: granted only to a member in good standing (adm.renew)."""
        e = self.table.entries.get(peer)
        if e is None or self.wall is None or self.record.left:
            return []
        try:
            chain = adm.renew(self.key, self.chain, peer, e.record.chain, self.mesh_id, self.table.revoked, self.wall,
                              self.admit_s)  # fmt: skip
        except ValueError:
            return []  # it asks another peer, or its admission ends
        return [(peer, Renewal(chain=adm.chain_to_wire(chain)))]

    def _take_renewal(self, peer: NodeId, msg: Renewal, now: float) -> Out:
        """Our new admission chain, from the peer we asked: taken if it is ours, holds, keeps our scope and holds
        longer than the one we have."""
        if self.wall is None:
            return []
        try:
            chain = adm.chain_from_wire(msg.chain)
        except RemoteProtocolError:
            return []
        if (adm.verify_chain(chain, self.me, self.mesh_id, self.wall) is not None
                or adm.chain_scope(chain) != adm.chain_scope(self.chain)
                or adm.chain_until(chain) <= adm.chain_until(self.chain)):  # fmt: skip
            return []
        self.chain = chain
        self._renew_asked = -1e18
        self.events.append(Event(EventKind.RENEWED, peer, str(int(adm.chain_until(chain)))))
        self.record = dataclasses.replace(self.record, seq=self.record.seq + 1, chain=tuple(chain))
        self._sign()
        self._last_beat = now
        return self._to_all(GossipPush(records=[self._raw_self]))

    def _renewal(self, now: float, wall: float) -> Out:
        """Ask the best connected peer to renew our admission once half of it is over; say when it has ended."""
        if wall >= adm.chain_until(self.chain):
            if not self._expired_told:
                self._expired_told = True
                self.events.append(Event(EventKind.EXPIRED, self.me, adm.admission_ended(self.chain, wall)))
            return []
        if not adm.needs_renewal(self.chain, wall) or now - self._renew_asked < RENEW_RETRY_S:
            return []
        mine = adm.chain_scope(self.chain)
        best = max(
            (e.record for p in self.peers if (e := self.table.entries.get(p)) is not None and e.record.scope >= mine
             and adm.chain_until(e.record.chain) > adm.chain_until(self.chain)),
            key=lambda r: (adm.better_renewer(r.chain), r.node), default=None,
        )  # fmt: skip
        if best is None:
            return []
        self._renew_asked = now
        return [(best.node, RenewAsk())]

    def revoke(self, revocations: list[sgn.Revocation], now: float, grants: list[sgn.Grant] | None = None,
               directives: list[sgn.Directive] | None = None) -> Out:  # fmt: skip
        """Revocations, admin grants and serve / drop words made on this machine (``mesh-llm revoke``, ``admin``,
        ``serve``, ``drop``) or kept in its state dir: taken and gossiped like any."""
        before = set(self.table.entries)
        res = MergeResult()
        for g in grants or []:
            self.table.add_grant(g, res)
        for d in directives or []:
            self.table.add_directive(d, res)
        for r in revocations:
            self.table.add_revocation(r, res)
        return self._after_merge(res, before, exclude=None, now=now)

    def _after_merge(self, res: MergeResult, before: set[NodeId], exclude: NodeId | None, now: float) -> Out:
        out: Out = []
        for n in res.cut:
            self.events.append(Event(EventKind.REVOKED, n))
        for n in res.expired:
            self.events.append(Event(EventKind.EXPIRED, n))
        if res.revoked_me or (res.new_revocations and not self._out and adm.cut_off(self.chain, self.table.revoked)):
            self._out = True  # revoked, or admitted through a node that was: out for good (told once)
            self.events.append(Event(EventKind.REVOKED, self.me))
        after = set(self.table.entries)
        for n in sorted(after - before):
            self.events.append(Event(EventKind.JOINED, n))
        for t in res.new_tombstones:
            if t.node in before and t.node not in after:
                self.events.append(Event(EventKind.LEFT if t.by == t.node else EventKind.DIED, t.node))
        if res.refuted:
            # someone buried our current life (a false death or a healed partition): come back as a new life
            self.incarnation += 1
            self.table.my_incarnation = self.incarnation
            self.events.append(Event(EventKind.REFUTED, self.me, f"incarnation {self.incarnation}"))
            self.record = dataclasses.replace(self.record, incarnation=self.incarnation, seq=0)
            self._sign()
            out += self._to_all(GossipPush(records=[self._raw_self]))
        if res.new_raw or res.new_tombstones or res.new_revocations or res.new_grants or res.new_directives:
            push = GossipPush(records=res.new_raw, tombstones=[t.to_wire() for t in res.new_tombstones if t.sig],
                              revocations=[r.to_wire() for r in res.new_revocations],
                              admins=[g.to_wire() for g in res.new_grants],
                              directives=[d.to_wire() for d in res.new_directives])  # fmt: skip
            self.events += [Event(EventKind.DIRECTIVE, d.by, f"{'serve' if d.serve else 'drop'} {d.model}")
                            for d in res.new_directives]  # fmt: skip
            out += [(p, push) for p in sorted(self.peers) if p != exclude]
        return out

    def _to_all(self, msg: Message) -> Out:
        return [(p, msg) for p in sorted(self.peers)]

    # ---------------------------------------------------------------- time

    def tick(self, now: float, wall: float | None = None) -> Out:
        """Heartbeats, deaths by silence; with ``wall`` (admissions end at wall times) also renewals and the
        admissions that ended."""
        out: Out = []
        if wall is not None:
            self.wall = self.table.wall = wall
            out += self._renewal(now, wall)
        if now - self._last_beat >= HEARTBEAT_S:
            rtt = {p: round(v, 2) for p, v in self.rtt_ms.items()}
            links = {p: v for p, v in self.links.items() if p in self.peers}
            out += self.update(now, rtt_ms=rtt, links=links)
            out += [(p, Ping(t=now)) for p in sorted(self.peers)]
        before = set(self.table.entries)
        res = self.table.expire(self.key, now)
        self.table.drop_expired(res)
        for p in sorted(self.peers):
            e = self.table.entries.get(p)
            if e is not None and now - self._heard.get(p, now) >= DIRECT_DEAD_S:
                t = Tombstone(p, e.record.incarnation, self.me, now).signed(self.key)
                self.table.add_tombstone(t, now, res)
        out += self._after_merge(res, before, exclude=None, now=now)
        return out

    # ---------------------------------------------------------------- views

    def alive(self, now: float) -> list[PeerRecord]:
        """Every live node, ourselves included."""
        return [self.record, *self.table.alive(now)]

    def liveness(self, node: NodeId, now: float) -> Liveness:
        return Liveness.ALIVE if node == self.me else self.table.liveness(node, now)

    def wants_to_dial(self, now: float) -> list[PeerRecord]:
        """Live nodes we should connect to: one connection per pair, dialled by the smaller NodeId (a client
        dials everyone: nobody dials a client), or by either once they have been apart DIAL_FALLBACK_S."""
        if self.record.left:
            return []  # leaving: connecting to anyone now would only be news of a node that is gone
        i_dial = self.record.role == Role.CLIENT
        # nodes declared dead are retried too: after a partition heals, that is how the sides find each other
        known = self.table.alive(now) + list(self.table.graveyard.values())
        out = []
        for r in known:
            if r.node in self.peers or not r.addrs or r.role == Role.CLIENT:
                self._apart.pop(r.node, None)
                continue
            apart = now - self._apart.setdefault(r.node, now)
            if not (i_dial or designated_dialler(self.me, r.node) == self.me or apart >= DIAL_FALLBACK_S):
                continue
            if now - self._dialled.get(r.node, -1e18) < DIAL_RETRY_S:
                continue
            self._dialled[r.node] = now
            out.append(r)
        for gone in set(self._apart) - {r.node for r in known}:
            del self._apart[gone]
        return out

    def serving_host(self, model: str | None, now: float) -> NodeId | None:
        """The host a request for ``model`` (any model when None) goes to: the one this node's own election picks
        among the host-scoped records of that model, once it says it serves and we are connected to it. A record's
        word that it hosts is never enough (any member could gossip one: the first such record in table order once
        received every prompt of the mesh); a lite client runs the same election for every model it routes."""
        recs = self.alive(now)
        for fp, host in self._elected(recs, model):
            rec = next((r for r in recs if r.node == host), None)
            if (rec is not None and rec.role == Role.HOST and rec.state == NodeState.SERVING and rec.node in self.peers
                    and rec.model is not None and rec.model.fingerprint == fp):  # fmt: skip
                return rec.node
        return None

    def hosts_for(self, model: str | None, now: float) -> list[PeerRecord]:
        """Every peer a request for ``model`` (any when None) may go to: the host our election picks and
        the replicas beside it — host-scoped records marked ``replica``, holding the whole model, that the elected
        host's plan does not use — each once it says it serves and we are connected to it; this node left out. The
        elected host first; the first model (by fingerprint) that has any."""
        recs = self.alive(now)
        for fp, host in self._elected(recs, model):
            used = next((set(r.planned) for r in recs if r.node == host), set())
            out = [r for r in recs if r.node in self.peers and r.role == Role.HOST and r.state == NodeState.SERVING
                   and _may_host(r) and r.whole and r.model is not None and r.model.fingerprint == fp
                   and (r.node == host or (r.replica and r.node not in used))]  # fmt: skip
            if out:
                return sorted(out, key=lambda r: (r.node != host, r.node))
        return []

    def _elected(self, recs: list[PeerRecord], model: str | None) -> list[tuple[str, NodeId | None]]:
        """Each model named ``model`` (any when None) that a host-scoped record holds, by fingerprint, with the host
        our election picks for it (our own debounced one for our model)."""
        mine = self.record.model.fingerprint if self.record.model else None
        fps = sorted({r.model.fingerprint for r in recs
                      if r.model and self._servable(r) and model in (None, r.model.source)})  # fmt: skip
        cur = self._election.current
        return [(fp, cur if fp == mine and cur is not None else self._elect(recs, fp)) for fp in fps]

    def served_models(self, now: float) -> list[str]:
        """The names the mesh serves models under: those of nodes that may host them (a client- or worker-scoped
        member's record adds no name)."""
        names = sorted({r.model.source for r in self.alive(now) if r.model is not None and self._servable(r)})
        serving.remember(self.known_models, names)
        return names

    def _elect(self, recs: list[PeerRecord], fp: str) -> NodeId | None:
        """``_elect`` among the records whose model is not dropped: a copy of the same file served under another
        name (``mesh-llm drop`` names one) is a candidate, one under the dropped name is none."""
        return _elect([r for r in recs if r.model is None or not self.table.dropped(r.model.source)], fp)

    def _servable(self, r: PeerRecord) -> bool:
        """Whether ``r`` may host its model: host-scoped, not a client, and its model not dropped (``mesh-llm
        drop``)."""
        return r.model is not None and _may_host(r) and not self.table.dropped(r.model.source)

    def silent_s(self, node: NodeId, now: float) -> float:
        """Seconds since we last heard news from ``node`` (0 for ourselves; inf for a node we do not know)."""
        return 0.0 if node == self.me else self.table.silent_s(node, now)

    def host_of(self, rec: PeerRecord, now: float) -> PeerRecord | None:
        """The record of the host of ``rec``'s model as our election picks it (for a lite client's record, the
        host this node routes to): what :mod:`proto.standing` judges every node by."""
        if rec.model is None:
            return self.host_record(now)
        fp = rec.model.fingerprint
        mine = self.record.model.fingerprint if self.record.model else None
        recs = self.alive(now)
        host = self._election.current if fp == mine and self._election.current is not None else self._elect(recs, fp)
        return next((r for r in recs if r.node == host), None) if host is not None else None

    def host_record(self, now: float) -> PeerRecord | None:
        """The record of the host this node routes to (or, for a node with a model, elected): whose ``why`` every
        node gives as the reason it cannot serve. Never a record that merely claims the role."""
        host = self.serving_host(None, now) or self._election.current
        if host is None and self.record.model is None:  # a lite client: the election of any model the mesh has
            recs = self.alive(now)
            fps = sorted({r.model.fingerprint for r in recs if r.model is not None and self._servable(r)})
            host = next((h for fp in fps if (h := self._elect(recs, fp)) is not None), None)
        return next((r for r in self.alive(now) if r.node == host), None) if host is not None else None

    def sitting_host_for_me(self, now: float) -> NodeId | None:
        """While our election settles (None yet): the host it picks now, when that one already sits — it runs a plan
        that names us (not a replica's). Its key requests need not wait out our debounce: every new split's host
        waited those 2 s for its worker's key. Our election's own pick, from our table; None else."""
        fp = self.record.model.fingerprint if self.record.model else None
        if fp is None or self._election.current is not None:
            return None
        recs = self.alive(now)
        cand = self._elect(recs, fp)
        rec = next((r for r in recs if r.node == cand), None)
        sits = rec is not None and rec.role == Role.HOST and not rec.replica and self.me in rec.planned
        return cand if sits and cand != self.me else None

    def elected_for(self, fp: str, now: float) -> NodeId | None:
        """The host our election picks for the model ``fp`` now (not debounced; any model, ours or not): whose
        manifest a fetch of that model believes."""
        return self._elect(self.alive(now), fp)

    def elected_host(self, now: float) -> NodeId | None:
        """The debounced host for our model (None: no candidate yet, or still settling)."""
        fp = self.record.model.fingerprint if self.record.model else None
        if fp is None:
            return None
        before = self._election.current
        host = self._election.propose(self._elect(self.alive(now), fp), now)
        if host != before and host is not None:
            self.events.append(Event(EventKind.HOST, host))
        return host


def token_alternates(recs: list[PeerRecord], me: NodeId, scope: Scope) -> list[tuple[NodeId, list[str]]]:
    """The members an invite token of ``scope`` names for a joiner to dial when its issuer does not answer: those
    with addresses that may admit it — scoped at least as wide (a token named a client-scoped member,
    which refuses a host token) — the host first, then the biggest."""
    ok = [r for r in recs if r.node != me and r.addrs and r.role != Role.CLIENT and r.scope >= scope]
    return [(r.node, list(r.addrs)) for r in sorted(ok, key=lambda r: (r.role != Role.HOST, -r.capacity, r.node))]


def _may_host(r: PeerRecord) -> bool:
    return r.role != Role.CLIENT and r.scope >= Scope.HOST


def _elect(recs: list[PeerRecord], fp: str) -> NodeId | None:
    """The host of model ``fp`` by the election every node runs over the same records (proto/election.py)."""
    hosts = [r for r in recs if r.role == Role.HOST and not r.replica and _may_host(r) and r.model
             and r.model.fingerprint == fp]  # fmt: skip
    # after a partition heals there may be two sitting hosts: every node keeps the same one (a replica sits nowhere)
    sitting = max(hosts, key=lambda r: (r.capacity, r.node)).node if hosts else None
    cands = [Candidate(r.node, r.capacity, r.model.fingerprint if r.model and r.whole else None, r.role, r.scope,
                       r.device != "cpu")
             for r in recs]  # a partial copy of the model cannot host it  # fmt: skip
    return elect(cands, fp, sitting)
