"""Signed words about the mesh, pure: a revocation (the founder's or an admin's word that a member is out), an admin
grant (the founder's word that a member may revoke others) and a directive (``mesh-llm serve`` / ``drop``: the newest
word about a model counts). Each is checked against the mesh and the signer's standing where it is read from the
wire."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, replace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import RemoteProtocolError
from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.token import (
    _is_int,
)
from meshllm.proto.wire import pack


@dataclass(frozen=True)
class SignedWord:
    """A signed statement about one member, ``[mesh_id, node, at, by, sig]`` on the wire: a revocation or a grant."""

    mesh_id: bytes
    node: NodeId
    at: int
    by: NodeId
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([self.mesh_id, self.node, self.at, self.by])

    def to_wire(self) -> list[object]:
        return [self.mesh_id, self.node, self.at, self.by, self.sig]


@dataclass(frozen=True)
class Revocation(SignedWord):
    """The word of the founder (or of an admin it named, ``by``) that ``node`` is out: its chain, and every chain it
    signed a link of, admit nobody any more; its tokens admit nobody (their issuer is no member). Gossiped to every
    member and kept in each state dir, so a revoked node cannot come back with an old chain, an old token or a new
    token for the same key."""


@dataclass(frozen=True)
class Grant(SignedWord):
    """The founder's word (``by``) that ``node`` is an admin: it may revoke members too (never the founder or another
    admin). Gossiped and kept like revocations (state dir ``admins``)."""


def revoke(key: Ed25519PrivateKey, mesh_id: bytes, node: NodeId, now: float,
           admins: Container[NodeId] = frozenset()) -> Revocation:  # fmt: skip
    """ValueError unless ``key`` founded ``mesh_id`` or is one of its ``admins``, and may revoke ``node`` (an
    admin revokes neither the founder nor another admin; nobody revokes itself)."""
    me = crypto.node_id(key)
    why = _revoke_refused(mesh_id, me, node, admins)
    if why is not None:
        raise ValueError(why)
    r = Revocation(mesh_id, node, int(now), me)
    return replace(r, sig=crypto.sign(key, crypto.D_REVOKE, r.body()))


def _revoke_refused(mesh_id: bytes, by: NodeId, node: NodeId, admins: Container[NodeId]) -> str | None:
    founder = crypto.mesh_id_for(by) == mesh_id
    if not founder and by not in admins:
        return "only the node that founded the mesh, or an admin it named, can revoke members"
    if node == by:
        return "a node cannot revoke itself"
    if not founder and (crypto.mesh_id_for(node) == mesh_id or node in admins):
        return "an admin cannot revoke the founder or another admin"
    return None


def revocation_from_wire(obj: object, mesh_id: bytes, admins: Container[NodeId] = frozenset()) -> Revocation:
    """A revocation of this mesh, signed by its founder or one of ``admins``; RemoteProtocolError otherwise."""
    r = Revocation(*_signed_word(obj, "revocation"))
    why = _revoke_refused(mesh_id, r.by, r.node, admins) if r.mesh_id == mesh_id else "for another mesh"
    if why is not None:
        raise RemoteProtocolError(f"revocation refused: {why}")
    if not crypto.verify(r.by, crypto.D_REVOKE, r.body(), r.sig):
        raise RemoteProtocolError("revocation has a bad signature")
    return r


def grant_admin(key: Ed25519PrivateKey, mesh_id: bytes, node: NodeId, now: float) -> Grant:
    """ValueError unless ``key`` founded ``mesh_id`` and ``node`` is someone else."""
    me = crypto.node_id(key)
    if crypto.mesh_id_for(me) != mesh_id:
        raise ValueError("only the node that founded the mesh can name admins")
    if node == me:
        raise ValueError("the founder is more than an admin already")
    g = Grant(mesh_id, node, int(now), me)
    return replace(g, sig=crypto.sign(key, crypto.D_ADMIN, g.body()))


def grant_from_wire(obj: object, mesh_id: bytes) -> Grant:
    """An admin grant of this mesh, signed by its founder; RemoteProtocolError otherwise."""
    g = Grant(*_signed_word(obj, "admin grant"))
    if g.mesh_id != mesh_id or crypto.mesh_id_for(g.by) != mesh_id or g.node == g.by:
        raise RemoteProtocolError("admin grant not made by this mesh's founder")
    if not crypto.verify(g.by, crypto.D_ADMIN, g.body(), g.sig):
        raise RemoteProtocolError("admin grant has a bad signature")
    return g


def _signed_word(obj: object, what: str) -> tuple[bytes, NodeId, int, NodeId, bytes]:
    """The shape both revocations and grants have on the wire: [mesh_id, node, at, by, sig]."""
    if not (isinstance(obj, list) and len(obj) == 5):
        raise RemoteProtocolError(f"{what} malformed")
    mid, node, at, by, sig = obj
    if not (isinstance(mid, bytes) and isinstance(node, bytes) and len(node) == crypto.NODE_ID_LEN
            and _is_int(at) and isinstance(by, bytes) and len(by) == crypto.NODE_ID_LEN
            and isinstance(sig, bytes)):  # fmt: skip
        raise RemoteProtocolError(f"{what} malformed")
    return mid, node, at, by, sig


MODEL_NAME_MAX = 200  # a directive's model name (a catalog name, a hub reference or a served-as name)


@dataclass(frozen=True)
class Directive:
    """The word of the founder (or of an admin it named, ``by``) that the mesh serves ``model`` (``serve``) or stops
    serving it: ``mesh-llm serve NAME`` / ``mesh-llm drop NAME``. Gossiped and kept like grants (state dir
    ``directives``); for each model the newest word counts. Wire: [mesh_id, model, serve, at, by, sig]."""

    mesh_id: bytes
    model: str
    serve: bool
    at: int
    by: NodeId
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([self.mesh_id, self.model, self.serve, self.at, self.by])

    def to_wire(self) -> list[object]:
        return [self.mesh_id, self.model, self.serve, self.at, self.by, self.sig]

    def newer(self, other: Directive | None) -> bool:
        """Whether this word replaces ``other`` (about the same model): later, or as late and a drop."""
        return other is None or (self.at, not self.serve, self.sig) > (other.at, not other.serve, other.sig)


def direct(key: Ed25519PrivateKey, mesh_id: bytes, model: str, serve: bool, now: float,
           admins: Container[NodeId] = frozenset()) -> Directive:  # fmt: skip
    """ValueError unless ``key`` founded ``mesh_id`` or is one of its ``admins``, and ``model`` is a name."""
    me = crypto.node_id(key)
    if crypto.mesh_id_for(me) != mesh_id and me not in admins:
        raise ValueError("only the node that founded the mesh, or an admin it named, can serve or drop models")
    if not 0 < len(model) <= MODEL_NAME_MAX or not model.isprintable():
        raise ValueError(f"{model[:40]!r}: not a model name")
    d = Directive(mesh_id, model, serve, int(now), me)
    return replace(d, sig=crypto.sign(key, crypto.D_DIRECTIVE, d.body()))


def directive_from_wire(obj: object, mesh_id: bytes, admins: Container[NodeId] = frozenset()) -> Directive:
    """A serve or drop word of this mesh, signed by its founder or one of ``admins``; RemoteProtocolError otherwise."""
    if not (isinstance(obj, list) and len(obj) == 6):
        raise RemoteProtocolError("serve/drop word malformed")
    mid, model, serve, at, by, sig = obj
    if not (isinstance(mid, bytes) and isinstance(model, str) and 0 < len(model) <= MODEL_NAME_MAX
            and isinstance(serve, bool) and _is_int(at) and isinstance(by, bytes) and len(by) == crypto.NODE_ID_LEN
            and isinstance(sig, bytes)):  # fmt: skip
        raise RemoteProtocolError("serve/drop word malformed")
    d = Directive(mid, model, serve, at, by, sig)
    if mid != mesh_id or (crypto.mesh_id_for(by) != mesh_id and by not in admins):
        raise RemoteProtocolError("serve/drop word not made by this mesh's founder or an admin")
    if not crypto.verify(by, crypto.D_DIRECTIVE, d.body(), sig):
        raise RemoteProtocolError("serve/drop word has a bad signature")
    return d
