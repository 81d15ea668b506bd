"""Gossip, pure: the table of signed peer records (``record.py``), their merge, tombstones and liveness, and the
messages that carry them. Every entry takes ``now``.

Each node signs its own record. Records are ordered by (incarnation, seq): the incarnation is persisted and
bumped at every start, so a restarted node outranks its old records and any tombstone about its old life; seq
counts changes within one life, and a node re-signs (seq + 1) every HEARTBEAT_S so others can tell it is alive.

A tombstone says "node X, up to incarnation i, is gone" (it left, or a member saw it go silent). It beats every
record of X with incarnation <= i, so a departed node is never resurrected by an old record still travelling
through the mesh (the Rust original's ghost peers). A node that finds a tombstone about its current life (a
false death, a healed partition) refutes it by bumping its incarnation.

Records from keys without a valid admission chain for this mesh are dropped.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import RemoteProtocolError
from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.record import (
    MAX_RECORDS,
    PeerRecord,
    open_record,
    record_from_wire,
    record_version,
)
from meshllm.proto.wire import Message, message, pack

HEARTBEAT_S = 2.0
SUSPECT_AFTER_S = 4.0  # two heartbeats missed (a direct peer is declared dead at 6 s: DIRECT_DEAD_S)
DEAD_AFTER_S = 10.0
TOMBSTONE_TTL_S = 600.0
MAX_DEPARTED = 4096  # admission chains of members that left or died, kept (the oldest forgotten first)
# a record signed longer ago than this (by its own wall time) is stale: once a departed node's tombstone is forgotten
# (TOMBSTONE_TTL_S), its last record replayed must not bring it back. Half the tombstone's life leaves room for clocks
# that disagree by minutes.
MAX_RECORD_AGE_S = TOMBSTONE_TTL_S / 2
MAX_PEERS = 1024  # a member can mint identities of its own: the table (and the dialling) stays bounded
# ... and at most this many of them: the members admitted through any one member (directly or down the line,
# provenance included) that one table keeps. A member signing admissions for keys of its own offline fills its own
# share, never the table, so honest members (and new joiners) always fit.
MAX_THROUGH = 128


@dataclass(frozen=True)
class Tombstone:
    node: NodeId
    incarnation: int  # every life up to and including this one is over
    by: NodeId
    at: float
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([self.node, self.incarnation, self.by, int(self.at)])

    def signed(self, key: Ed25519PrivateKey) -> Tombstone:
        return dataclasses.replace(self, sig=crypto.sign(key, crypto.D_RECORD, b"tomb" + self.body()))

    def to_wire(self) -> list[Any]:
        return [self.node, self.incarnation, self.by, int(self.at), self.sig]


def tombstone_from_wire(obj: Any) -> Tombstone:
    if not (isinstance(obj, list) and len(obj) == 5):
        raise RemoteProtocolError("tombstone malformed")
    node, inc, by, at, sig = obj
    if not (isinstance(node, bytes) and isinstance(inc, int) and isinstance(by, bytes) and isinstance(at, int)
            and isinstance(sig, bytes)):  # fmt: skip
        raise RemoteProtocolError("tombstone malformed")
    t = Tombstone(node, inc, by, float(at), sig)
    if not crypto.verify(by, crypto.D_RECORD, b"tomb" + t.body(), sig):
        raise RemoteProtocolError("tombstone has a bad signature")
    return t


@message
@dataclass(frozen=True)
class GossipPush(Message):
    """Records, tombstones and revocations the sender thinks the receiver may lack (everything, on a new
    connection)."""

    TYPE = "gossip.push"
    records: list[bytes] = field(default_factory=list)
    tombstones: list[list[Any]] = field(default_factory=list)
    revocations: list[list[Any]] = field(default_factory=list)
    admins: list[list[Any]] = field(default_factory=list)  # the founder's admin grants (before revocations)
    directives: list[list[Any]] = field(default_factory=list)  # serve / drop words (the newest per model)


@message
@dataclass(frozen=True)
class Ping(Message):
    TYPE = "ping"
    t: float


@message
@dataclass(frozen=True)
class Pong(Message):
    TYPE = "pong"
    t: float


@message
@dataclass(frozen=True)
class RenewAsk(Message):
    """A member whose admission is half over asks a peer whose own holds longer to renew it (adm.renew)."""

    TYPE = "admit.renew"


@message
@dataclass(frozen=True)
class Renewal(Message):
    """The answer: the asker's new admission chain (the renewer's plus a fresh link)."""

    TYPE = "admit.renewal"
    chain: list[Any] = field(default_factory=list)


class Liveness(Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass
class Entry:
    record: PeerRecord
    raw: bytes
    fresh_at: float  # when we last saw a newer (incarnation, seq) from this node


@dataclass
class MergeResult:
    changed: list[NodeId] = field(default_factory=list)
    new_raw: list[bytes] = field(default_factory=list)  # to forward
    new_tombstones: list[Tombstone] = field(default_factory=list)
    refuted: bool = False  # a tombstone named our own current life
    new_revocations: list[sgn.Revocation] = field(default_factory=list)  # to forward (and keep on disk)
    new_grants: list[sgn.Grant] = field(default_factory=list)  # admin grants, likewise
    new_directives: list[sgn.Directive] = field(default_factory=list)  # serve / drop words, likewise
    cut: list[NodeId] = field(default_factory=list)  # members a revocation removed
    voided: list[NodeId] = field(default_factory=list)  # revocations that fell with the admin who signed them
    revoked_me: bool = False
    expired: list[NodeId] = field(default_factory=list)  # members whose admission ended (not renewed in time)
    dropped: list[str] = field(default_factory=list)  # why, for logs


class Table:
    """One node's view of the mesh: the latest verified record per node, and tombstones."""

    def __init__(self, me: NodeId, mesh_id: bytes) -> None:
        self.me = me
        self.mesh_id = mesh_id
        self.entries: dict[NodeId, Entry] = {}
        self.tombstones: dict[NodeId, Tombstone] = {}
        self.leaves: dict[NodeId, bytes] = {}  # signed leave records (self-issued tombstones)
        self._chains_ok: set[bytes] = set()
        self.graveyard: dict[NodeId, PeerRecord] = {}  # last record of nodes declared dead, until forgotten
        self.departed: OrderedDict[NodeId, tuple[adm.Link, ...]] = OrderedDict()  # chains of members gone away
        self.my_incarnation = 0  # our own current life (MeshCore keeps it): only it can be buried
        self.my_links: frozenset[NodeId] = frozenset()  # our connected peers as our record says: who may bury us
        self.revoked: dict[NodeId, sgn.Revocation] = {}  # for good: never forgotten
        self.admins: dict[NodeId, sgn.Grant] = {}  # whom the founder made admin (they may revoke members)
        self.directives: dict[str, sgn.Directive] = {}  # per model name: the newest serve / drop word
        self.wall: float | None = None  # wall time as of the last tick (admissions end at wall times); None: unchecked
        self._through: dict[NodeId, int] = {}  # per member: entries admitted through it (adm.lineage), for MAX_THROUGH

    # -- merging

    def _buried(self, node: NodeId, incarnation: int) -> bool:
        t = self.tombstones.get(node)
        return t is not None and incarnation <= t.incarnation

    def merge_record(self, raw: bytes, now: float, res: MergeResult | None = None) -> MergeResult:
        res = res or MergeResult()
        try:
            opened = open_record(raw)
            node, inc, seq = record_version(opened)
            old = self.entries.get(node)
            if node == self.me or self._buried(node, inc):
                return res
            if old is not None and (inc, seq) <= (old.record.incarnation, old.record.seq):
                return res  # not newer: skip the signature checks
            # a full table still takes a node it knew (a refutation after a false death: the honest member a flood
            # of identities once locked out for good), up to twice its size
            known = node in self.tombstones or node in self.graveyard
            if old is None and len(self.entries) >= (2 * MAX_PEERS if known else MAX_PEERS):
                raise RemoteProtocolError(f"peer table full ({MAX_PEERS} nodes): a new node's record dropped")
            rec = record_from_wire(raw, self.mesh_id, self._chains_ok, opened)
        except RemoteProtocolError as e:
            res.dropped.append(str(e))
            return res
        if rec.node == self.me:
            return res  # our own record comes from us
        if self._buried(rec.node, rec.incarnation):
            return res
        gone = adm.cut_off(rec.chain, self.revoked)
        if gone is not None:
            res.dropped.append(f"record of {crypto.short(rec.node)}: its admission passes through revoked "
                               f"{crypto.short(gone)}")  # fmt: skip
            return res
        if self.wall is not None and self.wall >= adm.chain_until(rec.chain):
            res.dropped.append(f"record of {crypto.short(rec.node)}: {adm.admission_ended(rec.chain, self.wall)}")
            return res
        if self.wall is not None and rec.at and rec.at < self.wall - MAX_RECORD_AGE_S:
            res.dropped.append(f"record of {crypto.short(rec.node)} signed {int(self.wall - rec.at)} s ago: stale")
            return res
        if self.wall is not None and rec.at > self.wall + tok.CLOCK_SKEW_S:
            # one signed far ahead would never go stale: a departed node's last record would come back as a ghost
            res.dropped.append(f"record of {crypto.short(rec.node)} signed {int(rec.at - self.wall)} s in the future")
            return res
        old = self.entries.get(rec.node)
        if old is not None and (rec.incarnation, rec.seq) <= (old.record.incarnation, old.record.seq):
            return res
        crowded = self._crowded(rec.chain, old.record.chain if old is not None else None)
        if crowded is not None:
            res.dropped.append(f"record of {crypto.short(rec.node)}: {MAX_THROUGH} members admitted through "
                               f"{crypto.short(crowded)} are known already")  # fmt: skip
            return res
        if rec.left:
            self.add_tombstone(Tombstone(rec.node, rec.incarnation, rec.node, now), now, res)
            self.leaves[rec.node] = raw  # the signed leave travels on as the tombstone
            res.new_raw.append(raw)
            return res
        self._put(Entry(rec, raw, now))
        self.graveyard.pop(rec.node, None)
        res.changed.append(rec.node)
        res.new_raw.append(raw)
        return res

    def add_tombstone(self, t: Tombstone, now: float, res: MergeResult | None = None) -> MergeResult:
        res = res or MergeResult()
        if t.node == self.me:
            res.refuted = True  # the caller bumps its incarnation past t.incarnation
            return res
        old = self.tombstones.get(t.node)
        if old is not None and old.incarnation >= t.incarnation:
            return res
        self.tombstones[t.node] = dataclasses.replace(t, at=now)
        e = self.entries.get(t.node)
        if e is not None and e.record.incarnation <= t.incarnation:
            self._drop(t.node)
            if t.by != t.node:  # declared dead by a member, not a leave of its own
                self.graveyard[t.node] = e.record  # where it was: worth a retry after a partition
            res.changed.append(t.node)
        res.new_tombstones.append(t)
        return res

    def tombstone_refused(self, t: Tombstone) -> str | None:
        """Why a tombstone from the wire is refused (None: taken). Its signer must be a member we have held a
        verified record of (alive, or buried: after a partition both sides have buried the other, and their
        tombstones are how they find each other again), and it may bury only a life we have seen (ours: the current
        one): a forged tombstone for a life far ahead would otherwise keep a node out for good, restarts included.
        And only a node it was connected to, as the buried node's own record says (ours: as we say): any member
        could otherwise bury any other, and a host's refuted life came back behind a self-claimed one. A node
        whose silence nobody connected to it reports is buried by each node itself (DEAD_AFTER_S)."""
        if t.by != self.me and not (t.by in self.entries or t.by in self.graveyard or t.by in self.tombstones):
            return "tombstone signed by a node that is not a known member"
        if t.node == self.me:
            if t.incarnation != self.my_incarnation:
                return "tombstone for a life of ours not being lived"
            return None if t.by in self.my_links else "tombstone for us by a member not connected to us"
        e = self.entries.get(t.node)
        known = e.record if e is not None else self.graveyard.get(t.node)
        if known is None:
            return "tombstone for a node we do not know"
        if t.incarnation > known.incarnation:
            return "tombstone for a life not seen yet"
        if t.by not in (self.me, t.node) and t.by not in known.links:
            return "tombstone by a member the node was not connected to"
        return None

    def add_revocation(self, r: sgn.Revocation, res: MergeResult | None = None) -> MergeResult:
        """Take a (verified) revocation: drop the records of every member whose chain passes through its node."""
        res = res or MergeResult()
        if r.node in self.revoked:
            return res
        self.revoked[r.node] = r
        res.new_revocations.append(r)
        if r.node == self.me:
            res.revoked_me = True
        if r.node in self.admins:
            # an admin's word counts only while it stands: what it revoked is void with it (taken while we had not
            # heard of its revocation yet, or signed after it and backdated), the founder re-revokes what should stay
            for node, word in list(self.revoked.items()):
                if word.by == r.node:
                    del self.revoked[node]
                    res.voided.append(node)
        for node, e in list(self.entries.items()):
            if adm.cut_off(e.record.chain, self.revoked) is not None:
                self._drop(node)
                self.graveyard.pop(node, None)
                res.changed.append(node)
                res.cut.append(node)
        return res

    def add_grant(self, g: sgn.Grant, res: MergeResult | None = None) -> MergeResult:
        """Take a (verified) admin grant."""
        res = res or MergeResult()
        if g.node not in self.admins:
            self.admins[g.node] = g
            res.new_grants.append(g)
        return res

    def add_directive(self, d: sgn.Directive, res: MergeResult | None = None) -> MergeResult:
        """Take a (verified) serve / drop word, when it is the newest about its model."""
        res = res or MergeResult()
        if d.newer(self.directives.get(d.model)):
            self.directives[d.model] = d
            res.new_directives.append(d)
        return res

    def directive(self, model: str) -> sgn.Directive | None:
        """The word that counts about ``model``: the newest, unless its signer is an admin revoked since."""
        d = self.directives.get(model)
        return d if d is not None and d.by not in self.revoked else None

    def dropped(self, model: str) -> bool:
        d = self.directive(model)
        return d is not None and not d.serve

    def merge_push(self, push: GossipPush, now: float) -> MergeResult:
        res = MergeResult()
        for obj in push.admins[:MAX_RECORDS]:  # first: a revocation may be an admin's
            try:
                self.add_grant(sgn.grant_from_wire(obj, self.mesh_id), res)
            except RemoteProtocolError as e:
                res.dropped.append(str(e))
        for obj in push.directives[:MAX_RECORDS]:
            try:
                self.add_directive(sgn.directive_from_wire(obj, self.mesh_id, self._standing_admins()), res)
            except RemoteProtocolError as e:
                res.dropped.append(str(e))
        for obj in push.revocations[:MAX_RECORDS]:
            try:
                self.add_revocation(sgn.revocation_from_wire(obj, self.mesh_id, self._standing_admins()), res)
            except RemoteProtocolError as e:
                res.dropped.append(str(e))
        for obj in push.tombstones[:MAX_RECORDS]:
            try:
                t = tombstone_from_wire(obj)
            except RemoteProtocolError as e:
                res.dropped.append(str(e))
                continue
            why = self.tombstone_refused(t)
            if why is None:
                self.add_tombstone(t, now, res)
            elif not (t.node in self.tombstones and self.tombstones[t.node].incarnation >= t.incarnation):
                res.dropped.append(why)  # (one we already hold, forwarded back to us, is no news)
        for raw in push.records[:MAX_RECORDS]:
            self.merge_record(raw, now, res)
        return res

    # -- the entries, and how many were admitted through each member

    def _put(self, e: Entry) -> None:
        old = self.entries.get(e.record.node)
        if old is not None:
            self._count(old.record.chain, -1)
        self.entries[e.record.node] = e
        self._count(e.record.chain, +1)

    def _drop(self, node: NodeId) -> None:
        chain = self.entries.pop(node).record.chain
        self._count(chain, -1)
        self.departed.pop(node, None)
        self.departed[node] = chain  # (revoked or ended: ``chain_of`` checks)
        while len(self.departed) > MAX_DEPARTED:
            self.departed.popitem(last=False)

    def _count(self, chain: tuple[adm.Link, ...], d: int) -> None:
        for n in adm.lineage(chain)[:-1]:  # every member it was admitted through (not itself, not the founder)
            self._through[n] = self._through.get(n, 0) + d
            if not self._through[n]:
                del self._through[n]

    def _crowded(self, chain: tuple[adm.Link, ...], had: tuple[adm.Link, ...] | None) -> NodeId | None:
        """A member through whom MAX_THROUGH entries are known already, that a record with ``chain`` (replacing one
        with ``had``) would pass; None when it fits."""
        before = set(adm.lineage(had)[:-1]) if had is not None else set()
        return next((n for n in adm.lineage(chain)[:-1] if n not in before
                     and self._through.get(n, 0) >= MAX_THROUGH), None)  # fmt: skip

    # -- liveness

    def silent_s(self, node: NodeId, now: float) -> float:
        e = self.entries.get(node)
        return now - e.fresh_at if e is not None else float("inf")

    def liveness(self, node: NodeId, now: float) -> Liveness:
        e = self.entries.get(node)
        if e is None:
            return Liveness.DEAD
        age = now - e.fresh_at
        if age >= DEAD_AFTER_S:
            return Liveness.DEAD
        if age >= SUSPECT_AFTER_S:
            return Liveness.SUSPECT
        return Liveness.ALIVE

    def drop_expired(self, res: MergeResult) -> None:
        """Members whose admission ended (at ``self.wall``) are members no more: dropped like revoked ones."""
        if self.wall is None:
            return
        for node, e in list(self.entries.items()):
            if self.wall >= adm.chain_until(e.record.chain):
                self._drop(node)
                res.changed.append(node)
                res.expired.append(node)
        for node, r in list(self.graveyard.items()):
            if self.wall >= adm.chain_until(r.chain):
                del self.graveyard[node]

    def expire(self, key: Ed25519PrivateKey, now: float) -> MergeResult:
        """Bury nodes silent for DEAD_AFTER_S (signed by us, to be gossiped); forget old tombstones."""
        res = MergeResult()
        me = crypto.node_id(key)
        for node, e in list(self.entries.items()):
            if now - e.fresh_at >= DEAD_AFTER_S:
                self.add_tombstone(Tombstone(node, e.record.incarnation, me, now).signed(key), now, res)
        for node, t in list(self.tombstones.items()):
            if now - t.at > TOMBSTONE_TTL_S:
                del self.tombstones[node]
                self.leaves.pop(node, None)
                self.graveyard.pop(node, None)
        return res

    def alive(self, now: float) -> list[PeerRecord]:
        """Records of nodes not (yet) dead, suspects included: they keep their role until declared dead."""
        return [e.record for n, e in self.entries.items() if self.liveness(n, now) is not Liveness.DEAD]

    def is_member(self, node: NodeId) -> bool:
        return node in self.entries

    def _standing_admins(self) -> set[NodeId]:
        """Admins whose word counts: those the founder named and nobody revoked."""
        return {n for n in self.admins if n not in self.revoked}

    def scope_of(self, node: NodeId) -> tok.Scope | None:
        """A member's scope, from its verified admission chain (None: not a member we know)."""
        chain = self.chain_of(node)
        return adm.chain_scope(chain) if chain is not None else None

    def chain_of(self, node: NodeId) -> tuple[adm.Link, ...] | None:
        """A member's verified admission chain (None: not a member we know). A member that left or went silent is
        still one until its admission ends or it is revoked: the tokens it minted still admit (checked by whoever
        a joiner reaches), so a token outlives its issuer's absence."""
        e = self.entries.get(node)
        if e is not None:
            return e.record.chain
        chain = self.departed.get(node)
        if chain is None or adm.cut_off(chain, self.revoked) is not None:
            return None
        return chain if self.wall is None or self.wall < adm.chain_until(chain) else None

    def push_all(self) -> GossipPush:
        return GossipPush(
            records=[e.raw for e in self.entries.values()] + list(self.leaves.values()),
            tombstones=[t.to_wire() for t in self.tombstones.values() if t.sig],
            revocations=[r.to_wire() for r in self.revoked.values()],
            admins=[g.to_wire() for g in self.admins.values()],
            directives=[d.to_wire() for d in self.directives.values()],
        )
