"""The first stream of every connection: who the dialler is, and whether it may be here. Pure.

The dialler already knows the listener is who it meant to reach: it pinned the listener's key through the TLS
certificate. The listener learns the dialler's key here::

    dialler -> AuthHello(dialler, listener, mesh_id)
    listener -> AuthChallenge(nonce)                       fresh 32 random bytes per connection
    dialler -> AuthProof(sig, proof, chain | token)
        sig   = Ed25519(dialler, "auth" || nonce || dialler || listener)
        proof = HMAC(mesh secret, "secret proof" || nonce || dialler || listener)
        chain = its admission chain (a member), or token = its invite token, secret blanked (a joiner)
    listener -> AuthWelcome(chain) | AuthRefuse(reason)

Both the signature and the proof are bound to this connection's nonce and to both keys, so a captured
AuthProof is worthless on another connection. A joiner is admitted only if the listener itself finds its token
signed by a member of this mesh, unexpired, and the proof made with the mesh's secret.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.wire import Message, message, pack

NONCE_LEN = 32
AUTH_MAX_FRAME = 64 * 1024


@message
@dataclass(frozen=True)
class AuthHello(Message):
    TYPE = "auth.hello"
    dialler: bytes
    listener: bytes
    mesh_id: bytes


@message
@dataclass(frozen=True)
class AuthChallenge(Message):
    TYPE = "auth.challenge"
    nonce: bytes


@message
@dataclass(frozen=True)
class AuthProof(Message):
    TYPE = "auth.proof"
    sig: bytes
    proof: bytes
    chain: list[Any] | None = None
    token: str | None = None


@message
@dataclass(frozen=True)
class AuthWelcome(Message):
    TYPE = "auth.welcome"
    chain: list[Any] = field(default_factory=list)


@message
@dataclass(frozen=True)
class AuthRefuse(Message):
    TYPE = "auth.refuse"
    reason: str
    revocation: list[Any] | None = None  # the signed revocation that cuts the dialler off: it can check it itself


@message
@dataclass(frozen=True)
class Rekey(Message):
    """A new admission secret for the mesh, signed by its founder (``mesh-llm rotate``). It travels only to members,
    over their authenticated and encrypted connections, on gossip streams; each member takes a higher epoch, keeps
    it in mesh.json and passes it on, and gives it to every member that connects later. Tokens carry the secret
    they were minted with: from then on only tokens minted with the new one admit anybody."""

    TYPE = "mesh.rekey"
    mesh_id: bytes
    epoch: int
    secret: bytes
    by: bytes
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([self.mesh_id, self.epoch, self.secret, self.by])


def make_rekey(key: Ed25519PrivateKey, mesh_id: bytes, epoch: int, secret: bytes) -> Rekey:
    """ValueError unless ``key`` founded ``mesh_id``."""
    me = crypto.node_id(key)
    if crypto.mesh_id_for(me) != mesh_id:
        raise ValueError("only the node that founded the mesh can rotate its secret")
    if len(secret) != tok.SECRET_LEN or epoch < 1:
        raise ValueError("a new secret is 32 bytes, its epoch 1 or more")
    r = Rekey(mesh_id, epoch, secret, me)
    return replace(r, sig=crypto.sign(key, crypto.D_REKEY, r.body()))


def rekey_refused(r: Rekey, mesh_id: bytes) -> str | None:
    """Why a rekey is not one to take (None: it is this mesh's founder's, well formed)."""
    if r.mesh_id != mesh_id or crypto.mesh_id_for(r.by) != mesh_id:
        return "rekey not made by this mesh's founder"
    if not (
        isinstance(r.epoch, int) and r.epoch >= 1 and isinstance(r.secret, bytes) and len(r.secret) == tok.SECRET_LEN
    ):
        return "rekey malformed"
    if not crypto.verify(r.by, crypto.D_REKEY, r.body(), r.sig):
        return "rekey has a bad signature"
    return None


def _bound(nonce: bytes, dialler: NodeId, listener: NodeId) -> bytes:
    return nonce + dialler + listener


def pair_token(nonce: bytes, dialler: NodeId, listener: NodeId) -> bytes:
    """The token a connection's two ends put in the relay packets they exchange (reach.py): from its challenge
    nonce, which only they have seen (it travelled inside the connection)."""
    return hashlib.sha256(b"mesh-llm pair token v1\0" + _bound(nonce, dialler, listener)).digest()[:8]


def make_proof(
    key: Ed25519PrivateKey,
    secret: bytes,
    challenge: AuthChallenge,
    listener: NodeId,
    chain: list[adm.Link] | None = None,
    token: tok.Token | None = None,
) -> AuthProof:
    """The dialler's answer to a challenge: as a member (chain) or as a joiner (token, its secret blanked)."""
    me = crypto.node_id(key)
    bound = _bound(challenge.nonce, me, listener)
    return AuthProof(
        sig=crypto.sign(key, crypto.D_AUTH, bound),
        proof=crypto.mac(secret, crypto.D_PROOF, bound),
        chain=adm.chain_to_wire(chain) if chain is not None else None,
        token=replace(token, secret=bytes(tok.SECRET_LEN)).encode() if token is not None else None,
    )


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # for the listener's log; also sent to the dialler
    chain: list[adm.Link] | None = None  # the dialler's chain when ok
    joined: bool = False  # newly admitted with a token
    revoked: NodeId | None = None  # refused as revoked, or admitted through this revoked node


def _refuse(reason: str) -> Verdict:
    return Verdict(False, reason)


def check_proof(
    *,
    key: Ed25519PrivateKey,
    my_chain: list[adm.Link],
    mesh_id: bytes,
    secret: bytes,
    hello: AuthHello,
    nonce: bytes,
    proof: AuthProof,
    scope_of: Callable[[NodeId], tok.Scope | None],  # a member's scope from the verified table; None: not one
    chain_of: Callable[[NodeId], tuple[adm.Link, ...] | None] = lambda _: None,  # a member's verified chain
    revoked: Container[NodeId] = frozenset(),  # nodes the founder revoked
    previous: Sequence[bytes] = (),  # secrets before the last rotations: a member may still prove with one
    now: float,
    admit_s: float = tok.ADMIT_S,  # how long the admission of a joiner holds (unless renewed)
    in_touch: bool = True,  # we founded the mesh, or are connected to a member: our secret is the mesh's current one
) -> Verdict:
    """The listener's decision. Every check is made here, by the listener, whatever the dialler checked."""
    me = crypto.node_id(key)
    if hello.listener != me:
        return _refuse("dialled another node id")
    if len(hello.dialler) != crypto.NODE_ID_LEN:
        return _refuse("malformed node id")
    if hello.mesh_id != mesh_id:
        return _refuse(f"wrong mesh: it asked for {hello.mesh_id.hex()[:8]}, this is {mesh_id.hex()[:8]}")
    bound = _bound(nonce, hello.dialler, me)
    if not crypto.verify(hello.dialler, crypto.D_AUTH, bound, proof.sig):
        return _refuse("identity signature not made for this connection (forged or replayed)")
    if not crypto.mac_ok(secret, crypto.D_PROOF, bound, proof.proof) and not (
        proof.chain is not None and any(crypto.mac_ok(old, crypto.D_PROOF, bound, proof.proof) for old in previous)
    ):  # a member that was away when the secret rotated proves with the old one (and gets the new one once in)
        return _refuse("secret proof invalid: wrong mesh secret, or a proof replayed from another connection")
    if hello.dialler in revoked:
        return Verdict(False, "revoked from this mesh (by its founder or an admin)", revoked=hello.dialler)
    if proof.chain is not None:
        try:
            chain = adm.chain_from_wire(proof.chain)
        except Exception:
            return _refuse("malformed admission chain")
        why = adm.verify_chain(chain, hello.dialler, mesh_id, now)
        if why is not None:
            return _refuse(f"not a member: {why}")
        gone = adm.cut_off(chain, revoked)
        if gone is not None:
            return Verdict(False, f"admitted through {crypto.short(gone)}, whom the mesh revoked", revoked=gone)
        return Verdict(True, "member", chain)
    if proof.token is None:
        return _refuse("neither a token nor an admission chain")
    if not in_touch:  # away during a rotation, a member would still admit tokens of the secret it replaced
        return _refuse("this member is connected to no other member, so it cannot know the mesh's current secret: "
                       "join through another member")  # fmt: skip
    try:
        t = replace(tok.parse(proof.token), secret=secret)  # signed over the real secret: ours must match
    except tok.TokenError as e:
        return _refuse(str(e))
    if t.mesh_id != mesh_id:
        return _refuse("token for another mesh")
    if not t.signature_ok():
        return _refuse("token signature invalid: altered, or minted with another secret")
    if t.node is not None and t.node != hello.dialler:
        return _refuse(f"this token admits {crypto.short(t.node)} only (an approval names the node that knocked)")
    if now >= t.expires:
        return _refuse(f"token expired {int(now - t.expires)} s ago")
    if t.expires - now > tok.MAX_TTL_S:
        return _refuse(f"token lives past the {tok.MAX_TTL_S // 86400}-day limit")
    mine = adm.chain_scope(my_chain)
    founder = my_chain[0][1] if my_chain else None  # every chain starts with the founder's own link
    issuer = mine if t.issuer == me else scope_of(t.issuer)
    if issuer is None and t.issuer == founder:  # the founder, never seen by this member: it stays one for good
        issuer = adm.chain_scope(my_chain[:1])
    if issuer is None:
        return _refuse(f"token issuer {crypto.short(t.issuer)} is not a member of this mesh")
    if t.scope > issuer:
        return _refuse(f"token scope {t.scope} is wider than its issuer's ({issuer})")
    if t.scope > mine:
        return _refuse(f"this member is {mine}-scoped and cannot admit a {t.scope}: join through a {t.scope} member")
    if now >= adm.chain_until(my_chain):
        return _refuse("this member's own admission has ended: join through another member")
    # the token's issuer, and whoever admitted it, stay on record in the new link (provenance): revoking any of them
    # cuts this joiner too, though it is our chain that admits it
    issuer_chain = None
    if t.issuer != me:
        issuer_chain = chain_of(t.issuer) or (tuple(my_chain[:1]) if t.issuer == founder else None)
    via = adm.provenance(issuer_chain, my_chain, hello.dialler) if issuer_chain else () if t.issuer == me else (
        t.issuer,)  # fmt: skip
    try:
        chain = adm.admit(key, my_chain, hello.dialler, now, t.scope, admit_s, via)
    except ValueError as e:
        return _refuse(str(e))
    return Verdict(True, f"joined with a {t.scope} token", chain, joined=True)
