"""[lan] Asking to join a mesh found on the LAN, without a token: the knock and the doorbell that answers it.

A node that found a mesh's announcement (``serve/lan.py``: mDNS, which carries nothing secret) dials the announcing
member and sends a ``KnockAsk`` signed with its node key: which mesh, its name, when. The member (the founder or an
admin: the nodes that announce) answers ``waiting`` and lists the knock until someone there approves it
(``mesh-llm approve NODE``: a token of the scope chosen, kept for that node id in the state dir); the next knock is
answered ``approved`` with that token, over the same encrypted QUIC connection, to the key that signed the knock
only. A knock never authenticates the connection: it sees nothing of the mesh but the answer. Pure: no I/O; the
caller passes ``now`` (wall clock seconds) and the approvals."""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.proto import crypto
from meshllm.proto.crypto import NODE_ID_LEN, NodeId
from meshllm.proto.wire import Message, message

D_KNOCK = b"mesh-llm knock v1\0"
KNOCK_SKEW_S = 120.0  # a knock signed further from our clock than this is refused (a replay, a wrong clock)
MAX_WAITING = 32  # knocks listed at once; a full list forgets the one heard from longest ago
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


@message
@dataclass(frozen=True)
class KnockAnswer(Message):
    TYPE = "knock.answer"
    state: str  # WAITING, APPROVED or REFUSED
    token: str = ""  # APPROVED: an invite token for the knocking node
    reason: str = ""  # REFUSED: why


def _body(node: bytes, mesh_id: bytes, name: str, at: int) -> bytes:
    body: bytes = msgpack.packb([node, mesh_id, name, at])
    return body


def make_knock(key: Ed25519PrivateKey, mesh_id: bytes, name: str, now: float) -> KnockAsk:
    me, at, name = crypto.node_id(key), int(now), name[:MAX_NAME]
    return KnockAsk(me, mesh_id, name, at, crypto.sign(key, D_KNOCK, _body(me, mesh_id, name, at)))


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
    waiting: dict[NodeId, Knocker]

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
            if len(self.waiting) >= MAX_WAITING:
                del self.waiting[min(self.waiting.values(), key=lambda w: w.last).node]
            k = self.waiting[ask.node] = Knocker(ask.node, ask.name, addr, now, now)
        k.name, k.addr, k.last = ask.name, addr, now
        return KnockAnswer(WAITING)

    def _invalid(self, ask: KnockAsk, now: float) -> str:
        if ask.mesh_id != self.mesh_id:
            return "not this mesh"
        if len(ask.node) != NODE_ID_LEN or len(ask.name) > MAX_NAME or not ask.name.isprintable():
            return "malformed knock"
        if abs(ask.at - now) > KNOCK_SKEW_S:
            return f"the knock's time is more than {KNOCK_SKEW_S:.0f} s from ours: check the clock"
        if not crypto.verify(ask.node, D_KNOCK, _body(ask.node, ask.mesh_id, ask.name, ask.at), ask.sig):
            return "bad signature"
        return ""

    def forget(self, now: float) -> None:
        for n in [n for n, k in self.waiting.items() if now - k.last > WAIT_KEEP_S]:
            del self.waiting[n]
