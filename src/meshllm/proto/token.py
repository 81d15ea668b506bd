"""Invite tokens and admission chains. Pure: every check takes ``now``.

Token (what a member prints and a joiner pastes)::

    "mesh1." + base64url(msgpack([2, mesh_id, secret, issuer, addrs, expires, scope, sig]))

signed by ``issuer`` over ``msgpack([2, mesh_id, secret, issuer, addrs, expires, scope])``. The secret is the mesh's
admission secret: whoever holds a valid token can prove it to a member (see auth.py), and the member checks
the token itself — signature, issuer is a member, mesh, expiry, lifetime, scope — before admitting anyone.

Admission chain (what makes a node a member, carried in its gossip record and its auth): a list of links
``[mesh_id, node, by, at, scope, sig]``, each signed by ``by``. The first is the founder's self-link (``node ==
by``, ``mesh_id == mesh_id_for(founder)``, scope host); each next link is signed by the node of the previous one and
is no wider than it; the last names the member and its scope. So anyone can verify membership and scope without a
member list, and an expired token admits nobody new.

Scopes, narrowest first: ``client`` (the API only: it serves no layers), ``worker`` (serves layers for a host, is
never elected), ``host`` (may be elected host). A member mints tokens no wider than its own scope.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Container
from dataclasses import dataclass, replace
from enum import IntEnum

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import MeshError, RemoteProtocolError
from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.wire import pack, unpack

TOKEN_PREFIX = "mesh1."
TOKEN_VERSION = 2
MAX_TTL_S = 30 * 86400  # no token lives longer: a leaked one stops admitting within a month at most
MAX_TOKEN_CHARS = 4096
MAX_ADDRS = 16
MAX_CHAIN = 64
SECRET_LEN = 32
MESH_ID_LEN = 16


class Scope(IntEnum):
    """What a member may do; a wider scope includes the narrower ones."""

    CLIENT = 0  # the API only
    WORKER = 1  # and serve layers for a host
    HOST = 2  # and be elected host

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Scope:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown scope {text!r}: one of client, worker, host") from None


class TokenError(MeshError):
    """A token that cannot be used. ``reason`` is one of: malformed, signature, expired, wrong-mesh. Not a
    UserError: a peer's token is refused where it arrives; the user's own becomes one in ``serve/node.py``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"invite token {reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Token:
    mesh_id: bytes
    secret: bytes
    issuer: NodeId
    addrs: tuple[str, ...]
    expires: int  # unix seconds
    scope: Scope = Scope.HOST  # what the node it admits may do
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([TOKEN_VERSION, self.mesh_id, self.secret, self.issuer, list(self.addrs), self.expires,
                     int(self.scope)])  # fmt: skip

    def signed_by(self, key: Ed25519PrivateKey) -> Token:
        return replace(self, sig=crypto.sign(key, crypto.D_TOKEN, self.body()))

    def signature_ok(self) -> bool:
        return crypto.verify(self.issuer, crypto.D_TOKEN, self.body(), self.sig)

    def encode(self) -> str:
        raw = pack([TOKEN_VERSION, self.mesh_id, self.secret, self.issuer, list(self.addrs), self.expires,
                    int(self.scope), self.sig])  # fmt: skip
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def redacted(self) -> str:
        """For logs: never the token itself."""
        return (f"token(mesh {self.mesh_id.hex()[:8]}, issuer {crypto.short(self.issuer)}, scope {self.scope}, "
                f"expires {self.expires})")  # fmt: skip


def mint(key: Ed25519PrivateKey, mesh_id: bytes, secret: bytes, addrs: list[str], now: float, ttl_s: float,
         scope: Scope = Scope.HOST) -> Token:  # fmt: skip
    """A signed token; the caller checked ``scope`` against its own (``chain_scope``). ValueError over MAX_TTL_S."""
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"a token lives at most {MAX_TTL_S // 86400} days")
    addrs_ = tuple(addrs[:MAX_ADDRS])
    return Token(mesh_id, secret, crypto.node_id(key), addrs_, int(now + ttl_s), scope).signed_by(key)


def parse(text: str) -> Token:
    """Decode a token's structure. TokenError("malformed") for anything that is not one; no checks beyond shape."""
    text = text.strip()
    if len(text) > MAX_TOKEN_CHARS or not text.startswith(TOKEN_PREFIX):
        raise TokenError("malformed", f"expected text starting with {TOKEN_PREFIX!r}")
    b64 = text[len(TOKEN_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        obj = unpack(raw, max_len=MAX_TOKEN_CHARS)
    except (binascii.Error, ValueError, RemoteProtocolError):
        raise TokenError("malformed", "not valid base64/msgpack") from None
    if isinstance(obj, list) and obj and obj[0] == 1:
        raise TokenError("malformed", "a token of an older mesh-llm (version 1, before scopes): ask for a new one")
    if not isinstance(obj, list) or len(obj) != 8 or obj[0] != TOKEN_VERSION:
        raise TokenError("malformed", "unknown layout or version")
    _, mesh_id, secret, issuer, addrs, expires, scope, sig = obj
    if not (
        isinstance(mesh_id, bytes) and len(mesh_id) == MESH_ID_LEN
        and isinstance(secret, bytes) and len(secret) == SECRET_LEN
        and isinstance(issuer, bytes) and len(issuer) == crypto.NODE_ID_LEN
        and isinstance(addrs, list) and len(addrs) <= MAX_ADDRS
        and all(isinstance(a, str) and len(a) < 256 for a in addrs)
        and isinstance(expires, int) and not isinstance(expires, bool)
        and _is_scope(scope)
        and isinstance(sig, bytes) and len(sig) == crypto.SIG_LEN
    ):  # fmt: skip
        raise TokenError("malformed", "a field has the wrong type or size")
    return Token(mesh_id, secret, issuer, tuple(addrs), expires, Scope(scope), sig)


def _is_scope(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v in set(Scope)


def check(token: Token, now: float, mesh_id: bytes | None = None) -> Token:
    """The checks anyone can make: signature by the issuer, expiry, and (when known) the mesh."""
    if not token.signature_ok():
        raise TokenError("signature", "the token was altered or not signed by its issuer")
    if now >= token.expires:
        raise TokenError("expired", f"it expired {int(now - token.expires)} s ago; ask a member for a new one")
    if token.expires - now > MAX_TTL_S:
        raise TokenError("expired", f"it lives past the {MAX_TTL_S // 86400}-day limit on tokens (minted by hand?)")
    if mesh_id is not None and token.mesh_id != mesh_id:
        raise TokenError("wrong-mesh", f"it is for mesh {token.mesh_id.hex()[:8]}, this node is in {mesh_id.hex()[:8]}")
    return token


# ------------------------------------------------------------------------------------------ admission chains

Link = tuple[bytes, NodeId, NodeId, int, int, bytes]  # mesh_id, node, by, at, scope, sig


def _link_body(mesh_id: bytes, node: NodeId, by: NodeId, at: int, scope: int) -> bytes:
    return pack([mesh_id, node, by, at, scope])


def _link(key: Ed25519PrivateKey, mesh_id: bytes, node: NodeId, at: int, scope: Scope) -> Link:
    by = crypto.node_id(key)
    return (
        mesh_id,
        node,
        by,
        at,
        int(scope),
        crypto.sign(key, crypto.D_ADMIT, _link_body(mesh_id, node, by, at, scope)),
    )


def found(key: Ed25519PrivateKey, now: float) -> list[Link]:
    """The founder's chain: one self-signed link, scope host. The mesh id follows from the founder's key."""
    me = crypto.node_id(key)
    return [_link(key, crypto.mesh_id_for(me), me, int(now), Scope.HOST)]


def chain_scope(chain: list[Link] | tuple[Link, ...]) -> Scope:
    """The scope a (verified) chain gives its member: its last link's."""
    return Scope(chain[-1][4]) if chain else Scope.CLIENT


def admit(key: Ed25519PrivateKey, own_chain: list[Link], joiner: NodeId, now: float,
          scope: Scope = Scope.HOST) -> list[Link]:  # fmt: skip
    """The joiner's chain: ours plus one link signed by us. ValueError for a scope wider than ours."""
    if scope > chain_scope(own_chain):
        raise ValueError(f"a {chain_scope(own_chain)}-scoped member cannot admit a {scope}")
    return [*own_chain, _link(key, own_chain[0][0], joiner, int(now), scope)]


def verify_chain(chain: object, subject: NodeId, mesh_id: bytes) -> str | None:
    """None when ``chain`` proves ``subject`` a member of ``mesh_id``; else why not (for logs)."""
    if not isinstance(chain, list) or not 1 <= len(chain) <= MAX_CHAIN:
        return "admission chain missing or too long"
    prev: NodeId | None = None
    widest = Scope.HOST
    for i, link in enumerate(chain):
        if not (isinstance(link, list | tuple) and len(link) == 6):
            return f"link {i} malformed"
        mid, node, by, at, scope, sig = link
        if not (isinstance(mid, bytes) and isinstance(node, bytes) and isinstance(by, bytes)
                and isinstance(at, int) and _is_scope(scope) and isinstance(sig, bytes)):  # fmt: skip
            return f"link {i} malformed"
        if mid != mesh_id:
            return f"link {i} is for another mesh"
        if i == 0 and not (node == by and crypto.mesh_id_for(node) == mesh_id):
            return "chain does not start at the mesh's founder"
        if i > 0 and by != prev:
            return f"link {i} not signed by the previous member"
        if scope > widest:
            return f"link {i} gives scope {Scope(scope)}, wider than its signer's {widest}"
        if not crypto.verify(by, crypto.D_ADMIT, _link_body(mid, node, by, at, scope), sig):
            return f"link {i} has a bad signature"
        prev, widest = node, Scope(scope)
    if prev != subject:
        return "chain admits another node"
    return None


def chain_to_wire(chain: list[Link]) -> list[list[object]]:
    return [list(link) for link in chain]


def chain_from_wire(obj: object) -> list[Link]:
    """Shape only; verify_chain() decides membership."""
    if not isinstance(obj, list):
        raise RemoteProtocolError("admission chain is not a list")
    out: list[Link] = []
    for link in obj[: MAX_CHAIN + 1]:
        if not (isinstance(link, list) and len(link) == 6):
            raise RemoteProtocolError("admission link malformed")
        mid, node, by, at, scope, sig = link
        if not (isinstance(mid, bytes) and isinstance(node, bytes) and isinstance(by, bytes)
                and isinstance(at, int) and _is_scope(scope) and isinstance(sig, bytes)):  # fmt: skip
            raise RemoteProtocolError("admission link malformed")
        out.append((mid, node, by, at, scope, sig))
    return out


# ------------------------------------------------------------------------------------------ revocation


@dataclass(frozen=True)
class Revocation:
    """The founder's word that ``node`` is out: its chain, and every chain it signed a link of, admit nobody any
    more; its tokens admit nobody (their issuer is no member). Gossiped to every member and kept in each state dir,
    so a revoked node cannot come back with an old chain, an old token or a new token for the same key."""

    mesh_id: bytes
    node: NodeId
    at: int
    by: NodeId  # the founder
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([self.mesh_id, self.node, self.at, self.by])

    def to_wire(self) -> list[object]:
        return [self.mesh_id, self.node, self.at, self.by, self.sig]


def revoke(key: Ed25519PrivateKey, mesh_id: bytes, node: NodeId, now: float) -> Revocation:
    """ValueError unless ``key`` founded ``mesh_id`` (only the founder revokes) and ``node`` is someone else."""
    me = crypto.node_id(key)
    if crypto.mesh_id_for(me) != mesh_id:
        raise ValueError("only the node that founded the mesh can revoke members")
    if node == me:
        raise ValueError("the founder cannot revoke itself")
    r = Revocation(mesh_id, node, int(now), me)
    return replace(r, sig=crypto.sign(key, crypto.D_REVOKE, r.body()))


def revocation_from_wire(obj: object, mesh_id: bytes) -> Revocation:
    """A revocation of this mesh, signed by its founder; RemoteProtocolError otherwise."""
    if not (isinstance(obj, list) and len(obj) == 5):
        raise RemoteProtocolError("revocation malformed")
    mid, node, at, by, sig = obj
    if not (isinstance(mid, bytes) and isinstance(node, bytes) and len(node) == crypto.NODE_ID_LEN
            and isinstance(at, int) and isinstance(by, bytes) and isinstance(sig, bytes)):  # fmt: skip
        raise RemoteProtocolError("revocation malformed")
    r = Revocation(mid, node, at, by, sig)
    if mid != mesh_id or crypto.mesh_id_for(by) != mesh_id or node == by:
        raise RemoteProtocolError("revocation not made by this mesh's founder")
    if not crypto.verify(by, crypto.D_REVOKE, r.body(), sig):
        raise RemoteProtocolError("revocation has a bad signature")
    return r


def cut_off(chain: list[Link] | tuple[Link, ...], revoked: Container[NodeId]) -> NodeId | None:
    """The revoked node a chain passes through (its member, or one that admitted it down the line), if any."""
    return next((link[1] for link in chain if link[1] in revoked), None)
