"""Invite tokens and admission chains. Pure: every check takes ``now``.

Token (what a member prints and a joiner pastes)::

    "mesh1." + base64url(msgpack([1, mesh_id, secret, issuer, addrs, expires, sig]))

signed by ``issuer`` over ``msgpack([1, mesh_id, secret, issuer, addrs, expires])``. The secret is the mesh's
admission secret: whoever holds a valid token can prove it to a member (see auth.py), and the member checks
the token itself — signature, issuer is a member, mesh, expiry — before admitting anyone.

Admission chain (what makes a node a member, carried in its gossip record and its auth): a list of links
``[mesh_id, node, by, at, sig]``, each signed by ``by``. The first is the founder's self-link (``node == by``,
``mesh_id == mesh_id_for(founder)``); each next link is signed by the node of the previous one; the last names
the member. So anyone can verify membership without a member list, and an expired token admits nobody new.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, replace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import MeshError, RemoteProtocolError
from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.wire import pack, unpack

TOKEN_PREFIX = "mesh1."
TOKEN_VERSION = 1
MAX_TOKEN_CHARS = 4096
MAX_ADDRS = 16
MAX_CHAIN = 64
SECRET_LEN = 32
MESH_ID_LEN = 16


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
    sig: bytes = b""

    def body(self) -> bytes:
        return pack([TOKEN_VERSION, self.mesh_id, self.secret, self.issuer, list(self.addrs), self.expires])

    def signed_by(self, key: Ed25519PrivateKey) -> Token:
        return replace(self, sig=crypto.sign(key, crypto.D_TOKEN, self.body()))

    def signature_ok(self) -> bool:
        return crypto.verify(self.issuer, crypto.D_TOKEN, self.body(), self.sig)

    def encode(self) -> str:
        raw = pack([TOKEN_VERSION, self.mesh_id, self.secret, self.issuer, list(self.addrs), self.expires, self.sig])
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def redacted(self) -> str:
        """For logs: never the token itself."""
        return f"token(mesh {self.mesh_id.hex()[:8]}, issuer {crypto.short(self.issuer)}, expires {self.expires})"


def mint(key: Ed25519PrivateKey, mesh_id: bytes, secret: bytes, addrs: list[str], now: float, ttl_s: float) -> Token:
    return Token(mesh_id, secret, crypto.node_id(key), tuple(addrs[:MAX_ADDRS]), int(now + ttl_s)).signed_by(key)


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
    if not isinstance(obj, list) or len(obj) != 7 or obj[0] != TOKEN_VERSION:
        raise TokenError("malformed", "unknown layout or version")
    _, mesh_id, secret, issuer, addrs, expires, sig = obj
    if not (
        isinstance(mesh_id, bytes) and len(mesh_id) == MESH_ID_LEN
        and isinstance(secret, bytes) and len(secret) == SECRET_LEN
        and isinstance(issuer, bytes) and len(issuer) == crypto.NODE_ID_LEN
        and isinstance(addrs, list) and len(addrs) <= MAX_ADDRS
        and all(isinstance(a, str) and len(a) < 256 for a in addrs)
        and isinstance(expires, int) and not isinstance(expires, bool)
        and isinstance(sig, bytes) and len(sig) == crypto.SIG_LEN
    ):  # fmt: skip
        raise TokenError("malformed", "a field has the wrong type or size")
    return Token(mesh_id, secret, issuer, tuple(addrs), expires, sig)


def check(token: Token, now: float, mesh_id: bytes | None = None) -> Token:
    """The checks anyone can make: signature by the issuer, expiry, and (when known) the mesh."""
    if not token.signature_ok():
        raise TokenError("signature", "the token was altered or not signed by its issuer")
    if now >= token.expires:
        raise TokenError("expired", f"it expired {int(now - token.expires)} s ago; ask a member for a new one")
    if mesh_id is not None and token.mesh_id != mesh_id:
        raise TokenError("wrong-mesh", f"it is for mesh {token.mesh_id.hex()[:8]}, this node is in {mesh_id.hex()[:8]}")
    return token


# ------------------------------------------------------------------------------------------ admission chains

Link = tuple[bytes, NodeId, NodeId, int, bytes]  # mesh_id, node, by, at, sig


def _link_body(mesh_id: bytes, node: NodeId, by: NodeId, at: int) -> bytes:
    return pack([mesh_id, node, by, at])


def found(key: Ed25519PrivateKey, now: float) -> list[Link]:
    """The founder's chain: one self-signed link. The mesh id follows from the founder's key."""
    me = crypto.node_id(key)
    mesh_id = crypto.mesh_id_for(me)
    at = int(now)
    return [(mesh_id, me, me, at, crypto.sign(key, crypto.D_ADMIT, _link_body(mesh_id, me, me, at)))]


def admit(key: Ed25519PrivateKey, own_chain: list[Link], joiner: NodeId, now: float) -> list[Link]:
    """The joiner's chain: ours plus one link signed by us."""
    mesh_id, me, at = own_chain[0][0], crypto.node_id(key), int(now)
    link = (mesh_id, joiner, me, at, crypto.sign(key, crypto.D_ADMIT, _link_body(mesh_id, joiner, me, at)))
    return [*own_chain, link]


def verify_chain(chain: object, subject: NodeId, mesh_id: bytes) -> str | None:
    """None when ``chain`` proves ``subject`` a member of ``mesh_id``; else why not (for logs)."""
    if not isinstance(chain, list) or not 1 <= len(chain) <= MAX_CHAIN:
        return "admission chain missing or too long"
    prev: NodeId | None = None
    for i, link in enumerate(chain):
        if not (isinstance(link, list | tuple) and len(link) == 5):
            return f"link {i} malformed"
        mid, node, by, at, sig = link
        if not (isinstance(mid, bytes) and isinstance(node, bytes) and isinstance(by, bytes)
                and isinstance(at, int) and isinstance(sig, bytes)):  # fmt: skip
            return f"link {i} malformed"
        if mid != mesh_id:
            return f"link {i} is for another mesh"
        if i == 0 and not (node == by and crypto.mesh_id_for(node) == mesh_id):
            return "chain does not start at the mesh's founder"
        if i > 0 and by != prev:
            return f"link {i} not signed by the previous member"
        if not crypto.verify(by, crypto.D_ADMIT, _link_body(mid, node, by, at), sig):
            return f"link {i} has a bad signature"
        prev = node
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
        if not (isinstance(link, list) and len(link) == 5):
            raise RemoteProtocolError("admission link malformed")
        mid, node, by, at, sig = link
        if not (isinstance(mid, bytes) and isinstance(node, bytes) and isinstance(by, bytes)
                and isinstance(at, int) and isinstance(sig, bytes)):  # fmt: skip
            raise RemoteProtocolError("admission link malformed")
        out.append((mid, node, by, at, sig))
    return out
