"""Invite tokens and admission chains. Pure: every check takes ``now``.

Token (what a member prints and a joiner pastes)::

    "mesh1." + base64url(msgpack([2, mesh_id, secret, issuer, addrs, expires, scope, sig]))

signed by ``issuer`` over ``msgpack([2, mesh_id, secret, issuer, addrs, expires, scope])``. The secret is the mesh's
admission secret: whoever holds a valid token can prove it to a member (see auth.py), and the member checks
the token itself — signature, issuer is a member, mesh, expiry, lifetime, scope — before admitting anyone.

Admission chain (what makes a node a member, carried in its gossip record and its auth): a list of links
``[mesh_id, node, by, at, until, scope, sig]`` (``[..., sig, via]`` where a link keeps provenance), each signed by
``by``. The first is the founder's self-link (``node ==
by``, ``mesh_id == mesh_id_for(founder)``, scope host, no end: the mesh is its founder's key); each next link is
signed by the node of the previous one, while that one's admission was in force, and is no wider than it; the last
names the member and its scope. So anyone can verify membership and scope without a member list, and an expired
token admits nobody new.

Admission expires: a link holds from ``at`` to ``until`` (at most MAX_ADMIT_S), and a chain holds while every link
does. A member in good standing renews before then (``renew``: a peer whose own chain holds longer signs it a new
last link); one that was away, or cut off, past its end is out, and the links it signed hold no longer than its own.

Provenance: a link's ``via`` names the members a node was first admitted through that its chain no longer shows — the
issuer of the token it joined with (when another member checked it), and, after a renewal replaced its chain with
the renewer's, every member of the chain before. A revocation cuts every chain that names the revoked node anywhere,
``via`` included, so a member cannot launder the keys it admitted (or a new key of its own) through a renewal by the
founder, or through a token it minted and another member checked.

Scopes, narrowest first: ``client`` (the API only: it serves no layers), ``worker`` (serves layers for a host, is
never elected), ``host`` (may be elected host). A member mints tokens no wider than its own scope.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
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


# ------------------------------------------------------------------------------------------ admission chains

# mesh_id, node, by, at, until (0: the founder's), scope, sig, via (provenance: see the module's text)
Link = tuple[bytes, NodeId, NodeId, int, int, int, bytes, tuple[NodeId, ...]]
NEVER = 0  # the founder's self-link has no end


def _link_body(mesh_id: bytes, node: NodeId, by: NodeId, at: int, until: int, scope: int,
               via: tuple[NodeId, ...]) -> bytes:  # fmt: skip
    return pack([mesh_id, node, by, at, until, scope, list(via)] if via else [mesh_id, node, by, at, until, scope])


def _link(key: Ed25519PrivateKey, mesh_id: bytes, node: NodeId, at: int, until: int, scope: Scope,
          via: tuple[NodeId, ...] = ()) -> Link:  # fmt: skip
    by = crypto.node_id(key)
    body = _link_body(mesh_id, node, by, at, until, scope, via)
    return (mesh_id, node, by, at, until, int(scope), crypto.sign(key, crypto.D_ADMIT, body), via)


def found(key: Ed25519PrivateKey, now: float) -> list[Link]:
    """The founder's chain: one self-signed link, scope host, no end. The mesh id follows from the founder's key."""
    me = crypto.node_id(key)
    return [_link(key, crypto.mesh_id_for(me), me, int(now), NEVER, Scope.HOST)]


def chain_scope(chain: list[Link] | tuple[Link, ...]) -> Scope:
    """The scope a (verified) chain gives its member: its last link's."""
    return Scope(chain[-1][5]) if chain else Scope.CLIENT


def chain_until(chain: list[Link] | tuple[Link, ...]) -> float:
    """When a chain stops admitting its member: the earliest end of its links (inf: the founder's own)."""
    return min((float(link[4]) for link in chain[1:]), default=float("inf"))


def admit(key: Ed25519PrivateKey, own_chain: list[Link], joiner: NodeId, now: float,
          scope: Scope = Scope.HOST, ttl_s: float = ADMIT_S, via: tuple[NodeId, ...] = ()) -> list[Link]:  # fmt: skip
    """The joiner's chain: ours plus one link signed by us, holding ``ttl_s`` (no longer than ours holds: the
    chain's end is its earliest link's), naming ``via`` (provenance: the members it was admitted through that the
    chain does not show). ValueError for a scope wider than ours, a lifetime over MAX_ADMIT_S, too long a via."""
    if scope > chain_scope(own_chain):
        raise ValueError(f"a {chain_scope(own_chain)}-scoped member cannot admit a {scope}")
    if not 0 < ttl_s <= MAX_ADMIT_S:
        raise ValueError(f"an admission holds at most {MAX_ADMIT_S // 86400} days")
    if len(via) > MAX_VIA:
        raise ValueError(f"admitted through more than {MAX_VIA} members")
    at = int(now)
    return [*own_chain, _link(key, own_chain[0][0], joiner, at, at + max(1, int(ttl_s)), scope, via)]


def lineage(chain: list[Link] | tuple[Link, ...]) -> list[NodeId]:
    """Every member a chain's node was admitted through, and the node itself, in order, once each: each link's
    provenance, then its node (the founder's self-link aside)."""
    out: list[NodeId] = []
    for link in chain[1:]:
        for n in (*link[7], link[1]):
            if n not in out:
                out.append(n)
    return out


def accountable(chain: list[Link] | tuple[Link, ...], admins: Container[NodeId] = frozenset()) -> NodeId:
    """Whom a member's requests count as where members share a bound (a host's door): the first node of
    its lineage that is neither the founder nor an admin — itself when the founder or an admin admitted it, the
    member that minted it when that member admitted it (keys a member mints for itself are that member). The
    founder and admins count as themselves."""
    founder = chain[0][1] if chain else b""
    for n in lineage(chain):
        if n != founder and n not in admins:
            return n
    return chain[-1][1] if chain else b""


def provenance(through: list[Link] | tuple[Link, ...], new_chain: list[Link], subject: NodeId) -> tuple[NodeId, ...]:
    """What a new last link must name so that no member ``through`` (the chain a node was admitted or renewed
    through) shows is lost: those of its lineage that ``new_chain`` (the signer's chain) does not show."""
    shown = set(lineage(new_chain)) | {new_chain[0][1], subject}
    return tuple(n for n in lineage(through) if n not in shown)


def verify_chain(chain: object, subject: NodeId, mesh_id: bytes, now: float | None = None) -> str | None:
    """None when ``chain`` proves ``subject`` a member of ``mesh_id`` (at ``now``: its admission has not ended;
    None skips that one check, for a caller that checks ``chain_until`` itself); else why not (for logs)."""
    if not isinstance(chain, list) or not 1 <= len(chain) <= MAX_CHAIN:
        return "admission chain missing or too long"
    prev: Link | None = None
    for i, link in enumerate(chain):
        if not _link_shape_ok(link):
            return f"link {i} malformed"
        mid, node, by, at, until, scope, sig, via = link
        if mid != mesh_id:
            return f"link {i} is for another mesh"
        if prev is None:
            if not (node == by and crypto.mesh_id_for(node) == mesh_id and until == NEVER):
                return "chain does not start at the mesh's founder"
        else:
            if by != prev[1]:
                return f"link {i} not signed by the previous member"
            if scope > prev[5]:
                return f"link {i} gives scope {Scope(scope)}, wider than its signer's {Scope(prev[5])}"
            if not at < until <= at + MAX_ADMIT_S:
                return f"link {i} holds longer than {MAX_ADMIT_S // 86400} days"
            if at + CLOCK_SKEW_S < prev[3] or (prev[4] != NEVER and at >= prev[4]):
                return f"link {i} was signed when its signer's own admission was not in force"
        if not crypto.verify(by, crypto.D_ADMIT, _link_body(mid, node, by, at, until, scope, via), sig):
            return f"link {i} has a bad signature"
        prev = link
    assert prev is not None
    if prev[1] != subject:
        return "chain admits another node"
    if now is not None:
        if prev[3] > now + CLOCK_SKEW_S:
            return "admission signed in the future (a clock far ahead?)"
        if now >= chain_until(chain):
            return admission_ended(chain, now)
    return None


def admission_ended(chain: list[Link] | tuple[Link, ...], now: float) -> str:
    return (f"admission expired {int(now - chain_until(chain))} s ago (not renewed in time): "
            "join again with a new token")  # fmt: skip


def _link_shape_ok(link: object) -> bool:
    if not (isinstance(link, list | tuple) and len(link) in (7, 8)):
        return False
    mid, node, by, at, until, scope, sig = link[:7]
    via = link[7] if len(link) == 8 else ()
    return (isinstance(mid, bytes) and isinstance(node, bytes) and isinstance(by, bytes) and _is_int(at)
            and _is_int(until) and _is_scope(scope) and isinstance(sig, bytes) and isinstance(via, list | tuple)
            and len(via) <= MAX_VIA
            and all(isinstance(n, bytes) and len(n) == crypto.NODE_ID_LEN for n in via))  # fmt: skip


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def needs_renewal(chain: list[Link] | tuple[Link, ...], now: float) -> bool:
    """Once less than half of the last link's span is left (never, for the founder)."""
    if len(chain) < 2:
        return False
    at, until = chain[-1][3], chain_until(chain)
    return now >= until - (until - at) / 2


def renew(key: Ed25519PrivateKey, own_chain: list[Link], asker: NodeId, asker_chain: list[Link] | tuple[Link, ...],
          mesh_id: bytes, revoked: Container[NodeId], now: float, ttl_s: float = ADMIT_S) -> list[Link]:  # fmt: skip
    """A member's new chain, signed by us: ours plus a fresh link of the scope it has now, naming (``via``) every
    member its chain before showed that ours does not — who first admitted it stays on record, so a revocation of
    that member still cuts it. Only for a member in good standing (its chain holds now and passes through nobody
    revoked), once half of its admission is over, when a renewal would keep it longer; ValueError (why not)
    otherwise."""
    why = verify_chain(list(asker_chain), asker, mesh_id, now)
    if why is not None:
        raise ValueError(f"not renewed: {why}")
    gone = cut_off(asker_chain, revoked)
    if gone is not None:
        raise ValueError(f"not renewed: admitted through {crypto.short(gone)}, whom the mesh revoked")
    # the asker's clock may run a little ahead of ours (or ours lag a tick): a tenth of the span, at most the skew
    slack = min(CLOCK_SKEW_S, (chain_until(asker_chain) - asker_chain[-1][3]) / 10) if len(asker_chain) > 1 else 0
    if not needs_renewal(asker_chain, now + slack):
        raise ValueError("not renewed: less than half of its admission is over")
    via = provenance(asker_chain, own_chain, asker)
    new = admit(key, own_chain, asker, now, chain_scope(asker_chain), ttl_s, via)
    if len(new) > MAX_CHAIN or chain_until(new) <= chain_until(asker_chain):
        raise ValueError("not renewed: this member's own admission ends sooner")
    return new


def better_renewer(chain: list[Link] | tuple[Link, ...]) -> tuple[float, int]:
    """How good a peer with this chain is at renewing others: the later its end and the shorter it is, the better."""
    return (chain_until(chain), -len(chain))


def chain_to_wire(chain: list[Link]) -> list[list[object]]:
    """Each link as 7 fields, or 8 where it names provenance (a link of an older version reads as one without)."""
    out: list[list[object]] = []
    for link in chain:
        via = link[7] if len(link) > 7 else ()  # a 7-field link (of the wire form, or older) names no provenance
        out.append([*link[:7], list(via)] if via else list(link[:7]))
    return out


def chain_from_wire(obj: object) -> list[Link]:
    """Shape only; verify_chain() decides membership."""
    if not isinstance(obj, list):
        raise RemoteProtocolError("admission chain is not a list")
    out: list[Link] = []
    for link in obj[: MAX_CHAIN + 1]:
        if not (isinstance(link, list) and _link_shape_ok(link)):
            raise RemoteProtocolError("admission link malformed")
        mid, node, by, at, until, scope, sig = link[:7]
        out.append((mid, node, by, at, until, scope, sig, tuple(link[7]) if len(link) == 8 else ()))
    return out


# ------------------------------------------------------------------------------------------ revocation


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


# ------------------------------------------------------------------------------------------ serve / drop

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


def cut_off(chain: list[Link] | tuple[Link, ...], revoked: Container[NodeId]) -> NodeId | None:
    """The revoked node a chain passes through (its member, one that admitted it down the line, or one a link names
    as its provenance), if any."""
    return next((n for n in lineage(chain) if n in revoked), None)
