"""Asking to join a mesh found on the LAN, without a token: the knock and the doorbell that answers it.

A node that found a mesh's announcement (``serve/life/lan.py``: mDNS, which carries nothing secret) dials the announcing
member and sends a ``KnockAsk`` signed with its node key: which mesh, its name, when, and the node it knocks at
(``to``: the key its QUIC connection pinned). The member (the founder or an admin: the nodes that announce) refuses
a knock addressed to another node — a neighbour that announced the mesh as its own and relayed a real node's knocks
 gets nothing from them — and otherwise answers ``waiting`` and lists the knock until someone there
approves it (``mesh-llm approve NODE``: a token of the scope chosen that admits that node's key only, kept for it in
the state dir); the next knock is answered ``approved`` with that token, over the same encrypted QUIC connection, to
the key that signed the knock only. A knock never authenticates the connection: it sees nothing of the mesh but the
answer.

The list is bounded: at most PER_SOURCE places per source address (a flood of fresh keys from one address evicts
its own knocks, never another machine's), MAX_WAITING in all; a knock evicted is remembered a while (``gone``) so
``mesh-llm approve`` still finds it. A refusal is final for the knocker only from the mesh's founder or an admin
(its answer carries the founder's grant): an announcement anyone can make must not end anyone's ``--join-lan``.
Pure: no I/O; the caller passes ``now`` (wall clock seconds) and the approvals."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import RemoteProtocolError
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto.crypto import NODE_ID_LEN, NodeId
from meshllm.proto.wire import Message, message

D_KNOCK = b"mesh-llm knock v2\0"
KNOCK_SKEW_S = 120.0  # a knock signed further from our clock than this is refused (a replay, a wrong clock)
MAX_WAITING = 32  # knocks listed at once; a full list forgets the one heard from longest ago
PER_SOURCE = 4  # knocks listed from one source address at once (its oldest goes first)
MAX_GONE = 256  # evicted knocks remembered for `mesh-llm approve`
WAIT_KEEP_S = 600.0  # a knock not repeated for this long is forgotten
MAX_NAME = 64
WAITING, APPROVED, REFUSED = "waiting", "approved", "refused"


@message
@dataclass(frozen=True)
class KnockAsk(Message):
    TYPE = "knock.ask"
    node: bytes
    mesh_id: bytes
    name: str
    at: int
    sig: bytes
    to: bytes = b""  # the node knocked at (an older mesh-llm's knock has none: refused)


@message
@dataclass(frozen=True)
class KnockAnswer(Message):
    TYPE = "knock.answer"
    state: str  # WAITING, APPROVED or REFUSED
    token: str = ""  # APPROVED: an invite token for the knocking node
    reason: str = ""  # REFUSED: why
    grant: list[Any] | None = None  # REFUSED by an admin: the founder's grant naming it (the refusal is final)


def _body(node: bytes, mesh_id: bytes, name: str, at: int, to: bytes) -> bytes:
    body: bytes = msgpack.packb([node, mesh_id, name, at, to])
    return body


def make_knock(key: Ed25519PrivateKey, mesh_id: bytes, name: str, now: float, to: NodeId) -> KnockAsk:
    """A knock at node ``to`` (the announcing member whose key our connection pins)."""
    me, at, name = crypto.node_id(key), int(now), name[:MAX_NAME]
    return KnockAsk(me, mesh_id, name, at, crypto.sign(key, D_KNOCK, _body(me, mesh_id, name, at, to)), to)


def refusal_is_final(ans: KnockAnswer, mesh_id: bytes, by: NodeId) -> bool:
    """Whether a refusal from ``by`` ends the knocking: it is the mesh's founder (the mesh id is its key's), or its
    answer carries the founder's grant naming it an admin. Anyone else's refusal is only a word."""
    if ans.state != REFUSED:
        return False
    if crypto.mesh_id_for(by) == mesh_id:
        return True
    try:
        return ans.grant is not None and sgn.grant_from_wire(ans.grant, mesh_id).node == by
    except RemoteProtocolError:
        return False


@dataclass
class Knocker:
    """A node that asked to join: as it says it is called, where it knocked from, when first and last heard."""

    node: NodeId
    name: str
    addr: str
    first: float
    last: float


@dataclass
class Doorbell:
    """The knocks a member has heard and not yet seen approved."""

    mesh_id: bytes
    me: NodeId  # the node that answers: a knock addressed to another is refused
    waiting: dict[NodeId, Knocker]
    gone: OrderedDict[NodeId, Knocker] = field(default_factory=OrderedDict)  # evicted, newest last

    def ring(self, ask: KnockAsk, addr: str, now: float, approved: Mapping[NodeId, str],
             members: Container[NodeId], refused: Container[NodeId] = ()) -> KnockAnswer:  # fmt: skip
        """The answer to ``ask`` from ``addr``: refused when it is not a valid knock for our mesh, comes from a
        node that is (or was: revoked) a member — a member joins with its admission — or from one ``mesh-llm refuse``
        named; ``approved`` with the token kept for it; else ``waiting`` (listed)."""
        why = self._invalid(ask, now)
        if why:
            return KnockAnswer(REFUSED, reason=why)
        if ask.node in members:
            return KnockAnswer(REFUSED, reason="already a member (or revoked): join with your admission")
        if ask.node in refused:
            self.waiting.pop(ask.node, None)
            return KnockAnswer(REFUSED, reason="the founder or an admin refused this node")
        token = approved.get(ask.node)
        if token:
            self.waiting.pop(ask.node, None)
            return KnockAnswer(APPROVED, token=token)
        self.forget(now)
        k = self.waiting.get(ask.node)
        if k is None:
            same = [w for w in self.waiting.values() if _source(w.addr) == _source(addr)]
            if len(same) >= PER_SOURCE:
                self._evict(min(same, key=lambda w: w.last))
            elif len(self.waiting) >= MAX_WAITING:
                self._evict(min(self.waiting.values(), key=lambda w: w.last))
            k = self.gone.pop(ask.node, None) or Knocker(ask.node, ask.name, addr, now, now)
            self.waiting[ask.node] = k
        k.name, k.addr, k.last = ask.name, addr, now
        return KnockAnswer(WAITING)

    def _evict(self, k: Knocker) -> None:
        del self.waiting[k.node]
        self.gone[k.node] = k
        while len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)

    def _invalid(self, ask: KnockAsk, now: float) -> str:
        if ask.mesh_id != self.mesh_id:
            return "not this mesh"
        if len(ask.node) != NODE_ID_LEN or len(ask.name) > MAX_NAME or not ask.name.isprintable():
            return "malformed knock"
        if abs(ask.at - now) > KNOCK_SKEW_S:
            return f"the knock's time is more than {KNOCK_SKEW_S:.0f} s from ours: check the clock"
        if not crypto.verify(ask.node, D_KNOCK, _body(ask.node, ask.mesh_id, ask.name, ask.at, ask.to), ask.sig):
            return "bad signature"
        if ask.to != self.me:
            return "the knock is addressed to another node (relayed by a node that announced this mesh as its own?)"
        return ""

    def forget(self, now: float) -> None:
        for n in [n for n, k in self.waiting.items() if now - k.last > WAIT_KEEP_S]:
            del self.waiting[n]
        for n in [n for n, k in self.gone.items() if now - k.last > WAIT_KEEP_S]:
            del self.gone[n]


def _source(addr: str) -> str:
    """The machine a knock came from: its address without the port."""
    return addr.rpartition(":")[0] or addr
