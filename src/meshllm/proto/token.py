"""Invite tokens and admission chains. Pure: every check takes ``now``.

Token (what a member prints and a joiner pastes)::

    "mesh1." + base64url(msgpack([2, mesh_id, secret, issuer, addrs, expires, scope, sig]))

signed by ``issuer`` over ``msgpack([2, mesh_id, secret, issuer, addrs, expires, scope])``. The secret is the mesh's
admission secret: whoever holds a valid token can prove it to a member (see auth.py), and the member checks
the token itself — signature, issuer is a member, mesh, expiry, lifetime, scope — before admitting anyone.

A token admits a node by the mesh's admission chains (``admission.py``); revocations, admin grants and serve/drop
words are ``signed.py``'s.

Scopes, narrowest first: ``client`` (the API only: it serves no layers), ``worker`` (serves layers for a host, is
never elected), ``host`` (may be elected host). A member mints tokens no wider than its own scope.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
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
ADMIT_S = 14 * 86400  # how long an admission holds unless renewed (renewed once half of it is left)
MAX_ADMIT_S = 30 * 86400  # no link holds longer, whoever signed it
CLOCK_SKEW_S = 300  # how far apart members' clocks may be where one checks what another signed
MAX_TOKEN_CHARS = 4096
MAX_ADDRS = 16
MAX_ALSO = 4  # other members a token names (a joiner dials them too when the issuer is away), each by its id
MAX_ALSO_ADDRS = 4  # and up to this many of its addresses
MAX_CHAIN = 64
SECRET_LEN = 32
MESH_ID_LEN = 16
MAX_VIA = 64  # provenance a link carries (the members a node was first admitted through that its chain no longer shows)


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
    # other members to dial when the issuer does not answer (any member checks a token): (node id, addresses)
    also: tuple[tuple[NodeId, tuple[str, ...]], ...] = ()
    node: NodeId | None = None  # the one node it admits (an approval names the key that knocked)

    def _tail(self) -> list[object]:
        """The optional fields, after the scope (in the body) or the signature (on the wire): none for a token
        without others and unbound (it signs as before either was), ``[also]`` with others, ``[also, node]``
        (``also`` maybe empty) when bound."""
        if self.node is not None:
            return [self._also(), self.node]
        return [self._also()] if self.also else []

    def body(self) -> bytes:
        fields = [TOKEN_VERSION, self.mesh_id, self.secret, self.issuer, list(self.addrs), self.expires,
                  int(self.scope)]  # fmt: skip
        return pack(fields + self._tail())

    def _also(self) -> list[list[object]]:
        return [[n, list(a)] for n, a in self.also]

    def members(self) -> list[tuple[NodeId, list[str]]]:
        """Every member the token names, the issuer first: (node id, addresses)."""
        return [(self.issuer, list(self.addrs)), *((n, list(a)) for n, a in self.also)]

    def signed_by(self, key: Ed25519PrivateKey) -> Token:
        return replace(self, sig=crypto.sign(key, crypto.D_TOKEN, self.body()))

    def signature_ok(self) -> bool:
        return crypto.verify(self.issuer, crypto.D_TOKEN, self.body(), self.sig)

    def encode(self) -> str:
        raw = pack([TOKEN_VERSION, self.mesh_id, self.secret, self.issuer, list(self.addrs), self.expires,
                    int(self.scope), self.sig, *self._tail()])  # fmt: skip
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def redacted(self) -> str:
        """For logs: never the token itself."""
        only = f", for {crypto.short(self.node)} only" if self.node is not None else ""
        return (f"token(mesh {self.mesh_id.hex()[:8]}, issuer {crypto.short(self.issuer)}, scope {self.scope}, "
                f"expires {self.expires}{only})")  # fmt: skip


def mint(key: Ed25519PrivateKey, mesh_id: bytes, secret: bytes, addrs: list[str], now: float, ttl_s: float,
         scope: Scope = Scope.HOST, also: list[tuple[NodeId, list[str]]] | None = None,
         node: NodeId | None = None) -> Token:  # fmt: skip
    """A signed token; the caller checked ``scope`` against its own (``chain_scope``). ValueError over MAX_TTL_S.
    ``also``: other members a joiner may dial (the first MAX_ALSO with addresses, MAX_ALSO_ADDRS of each).
    ``node``: the only node it admits (an approval's)."""
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"a token lives at most {MAX_TTL_S // 86400} days")
    me = crypto.node_id(key)
    others = tuple((n, tuple(a for a in ad if ip_port(a))[:MAX_ALSO_ADDRS]) for n, ad in also or [] if n != me)
    others = tuple(x for x in others if x[1])[:MAX_ALSO]
    addrs_ = tuple(addrs[:MAX_ADDRS])
    return Token(mesh_id, secret, me, addrs_, int(now + ttl_s), scope, also=others, node=node).signed_by(key)


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
    if not isinstance(obj, list) or len(obj) not in (8, 9, 10) or obj[0] != TOKEN_VERSION:
        raise TokenError("malformed", "unknown layout or version")
    _, mesh_id, secret, issuer, addrs, expires, scope, sig = obj[:8]
    also = _also(obj[8], empty_ok=len(obj) == 10) if len(obj) >= 9 else ()
    node = obj[9] if len(obj) == 10 else None
    if len(obj) == 10 and not (isinstance(node, bytes) and len(node) == crypto.NODE_ID_LEN):
        raise TokenError("malformed", "the node it is for has the wrong type or size")
    if not (
        isinstance(mesh_id, bytes) and len(mesh_id) == MESH_ID_LEN
        and isinstance(secret, bytes) and len(secret) == SECRET_LEN
        and isinstance(issuer, bytes) and len(issuer) == crypto.NODE_ID_LEN
        and isinstance(addrs, list) and len(addrs) <= MAX_ADDRS
        and all(ip_port(a) for a in addrs)
        and isinstance(expires, int) and not isinstance(expires, bool)
        and _is_scope(scope)
        and isinstance(sig, bytes) and len(sig) == crypto.SIG_LEN
    ):  # fmt: skip
        raise TokenError("malformed", "a field has the wrong type or size")
    return Token(mesh_id, secret, issuer, tuple(addrs), expires, Scope(scope), sig, also, node)


def _also(v: object, empty_ok: bool = False) -> tuple[tuple[NodeId, tuple[str, ...]], ...]:
    """The other members a token names; TokenError("malformed") for anything else (an empty list included, but in a
    bound token: a token without others has no such field, so its signature covers the same bytes as an older
    one's)."""
    if not (isinstance(v, list) and (0 if empty_ok else 1) <= len(v) <= MAX_ALSO):
        raise TokenError("malformed", "its list of other members has the wrong size")
    out = []
    for x in v:
        if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], bytes) and len(x[0]) == crypto.NODE_ID_LEN
                and isinstance(x[1], list) and 0 < len(x[1]) <= MAX_ALSO_ADDRS and all(ip_port(a) for a in x[1])):
            raise TokenError("malformed", "another member it names has the wrong type or size")  # fmt: skip
        out.append((x[0], tuple(x[1])))
    return tuple(out)


def ip_port(text: object) -> bool:
    """Whether ``text`` is an address as the mesh passes them around: an IP literal and a port ("1.2.3.4:5",
    "[::1]:5"). Never a host name: resolving one a peer sent would stall the event loop (a slow resolver once held
    every node's loop for 8 s and peers went suspect)."""
    if not isinstance(text, str) or len(text) > 64:
        return False
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    if host.startswith("["):
        host = host[1:-1] if host.endswith("]") else ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
