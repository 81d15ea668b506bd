"""Admission chains: what makes a node a member, carried in its gossip record and its auth. Pure: every check takes
``now``.

A chain is a list of links ``[mesh_id, node, by, at, until, scope, sig]`` (``[..., sig, via]`` where a link keeps
provenance), each signed by ``by``. The first is the founder's self-link (``node == by``, ``mesh_id ==
mesh_id_for(founder)``, scope host, no end: the mesh is its founder's key); each next link is signed by the node of
the previous one, while that one's admission was in force, and is no wider than it; the last names the member and its
scope. So anyone can verify membership and scope without a member list.

Admission expires: a link holds from ``at`` to ``until`` (at most MAX_ADMIT_S), and a chain holds while every link
does. A member in good standing renews before then (``renew``: a peer whose own chain holds longer signs it a new
last link); one that was away, or cut off, past its end is out, and the links it signed hold no longer than its own.

Provenance: a link's ``via`` names the members a node was first admitted through that its chain no longer shows — the
issuer of the token it joined with (when another member checked it), and, after a renewal replaced its chain with
the renewer's, every member of the chain before. A revocation cuts every chain that names the revoked node anywhere,
``via`` included (``cut_off``), so a member cannot launder the keys it admitted (or a new key of its own) through a
renewal by the founder, or through a token it minted and another member checked."""

from __future__ import annotations

from collections.abc import Container

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import RemoteProtocolError
from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.token import (
    ADMIT_S,
    CLOCK_SKEW_S,
    MAX_ADMIT_S,
    MAX_CHAIN,
    MAX_VIA,
    Scope,
    _is_int,
    _is_scope,
)
from meshllm.proto.wire import pack

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


def cut_off(chain: list[Link] | tuple[Link, ...], revoked: Container[NodeId]) -> NodeId | None:
    """The revoked node a chain passes through (its member, one that admitted it down the line, or one a link names
    as its provenance), if any."""
    return next((n for n in lineage(chain) if n in revoked), None)
