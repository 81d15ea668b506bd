"""Revocation evaded through renewal, performed against the real cores (MeshCore, the table, the listener's
admission check). A member signs admissions for keys of its own offline, has the founder renew them (a renewal used
to replace the chain with the founder's, after which no chain named the member), mints a token with one of them and
joins a fresh key with it at the founder; or mints a token itself that another member checks. Revoking the member
must leave every one of those keys out: their chains keep who first admitted them (``via``), renewals included."""

from __future__ import annotations

import os
import time

from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.auth import AuthChallenge, AuthHello, Verdict, check_proof, make_proof
from meshllm.proto.gossip import GossipPush, Renewal, RenewAsk
from meshllm.proto.meshcore import MeshCore
from meshllm.proto.record import PeerRecord

NOW = time.time()


def _join(f: MeshCore, key: crypto.Ed25519PrivateKey, secret: bytes, *, token: tok.Token | None = None,
          chain: list[adm.Link] | None = None, now: float = NOW) -> Verdict:  # fmt: skip
    """``key`` dials the founder's core with a token or its chain: the founder's own admission check."""
    hello = AuthHello(dialler=crypto.node_id(key), listener=f.me, mesh_id=f.mesh_id)
    nonce = os.urandom(32)
    proof = make_proof(key, secret, AuthChallenge(nonce), f.me, chain=chain, token=token)
    return check_proof(key=f.key, my_chain=f.chain, mesh_id=f.mesh_id, secret=secret, hello=hello, nonce=nonce,
                       proof=proof, scope_of=f.table.scope_of, chain_of=f.table.chain_of, revoked=f.table.revoked,
                       now=now)  # fmt: skip


def _gossip(f: MeshCore, key: crypto.Ed25519PrivateKey, chain: list[adm.Link], seq: int, now: float) -> None:
    rec = PeerRecord(crypto.node_id(key), 1, seq, chain=tuple(chain), at=int(NOW))
    f.on_message(crypto.node_id(key), GossipPush(records=[rec.to_wire(key)]), now)


def test_a_revoked_member_cannot_launder_keys_through_renewals_or_tokens() -> None:
    founder, m = crypto.new_key(), crypto.new_key()
    f = MeshCore(key=founder, mesh_id=crypto.mesh_id_for(crypto.node_id(founder)), chain=adm.found(founder, NOW - 60),
                 incarnation=1, now=0.0, wall=NOW)  # fmt: skip
    secret = os.urandom(tok.SECRET_LEN)
    nm = crypto.node_id(m)
    chain_m = adm.admit(founder, f.chain, nm, NOW - 30, tok.Scope.WORKER)
    _gossip(f, m, chain_m, 1, 0.0)
    # the member signs admissions for keys of its own, offline, that hold 20 s: half over at once
    sybils = [crypto.new_key() for _ in range(3)]
    laundered: list[tuple[crypto.Ed25519PrivateKey, list[adm.Link]]] = []
    for i, s in enumerate(sybils):
        ns = crypto.node_id(s)
        _gossip(f, s, adm.admit(m, chain_m, ns, NOW - 15, tok.Scope.WORKER, ttl_s=20), 1, 0.1)
        f.tick(1.0 + i, NOW)
        out = f.on_message(ns, RenewAsk(), 1.0 + i)  # the founder renews it
        assert len(out) == 1 and isinstance(out[0][1], Renewal)
        renewed = adm.chain_from_wire(out[0][1].chain)
        assert len(renewed) == 2 and renewed[-1][2] == f.me  # the member no longer shows in the chain ...
        assert adm.verify_chain(renewed, ns, f.mesh_id, NOW) is None
        _gossip(f, s, renewed, 2, 1.2 + i)
        laundered.append((s, renewed))
    # ... a laundered key mints a token; a fresh key of the member joins with it at the founder
    s0 = sybils[0]
    t0 = tok.mint(s0, f.mesh_id, secret, [], NOW, 3600, tok.Scope.WORKER)
    fresh = crypto.new_key()
    v = _join(f, fresh, secret, token=t0)
    assert v.ok and v.chain is not None and len(v.chain) == 2, v.reason
    laundered.append((fresh, v.chain))
    _gossip(f, fresh, v.chain, 1, 5.0)
    # ... and a token the member mints itself, checked by the founder, admits another
    direct = crypto.new_key()
    v = _join(f, direct, secret, token=tok.mint(m, f.mesh_id, secret, [], NOW, 3600, tok.Scope.WORKER))
    assert v.ok and v.chain is not None and [link[1] for link in v.chain] == [f.me, crypto.node_id(direct)]
    laundered.append((direct, v.chain))
    _gossip(f, direct, v.chain, 1, 5.1)
    ids = {crypto.node_id(k) for k, _ in laundered}
    assert ids | {nm} <= set(f.table.entries)

    f.revoke([sgn.revoke(founder, f.mesh_id, nm, NOW + 1)], 6.0)

    left = (ids | {nm}) & set(f.table.entries)
    assert not left, f"still members: {sorted(crypto.short(n) for n in left)}"
    for key, chain in laundered:
        v = _join(f, key, secret, chain=chain, now=NOW + 2)
        assert not v.ok and v.revoked == nm, v.reason  # refused, naming the member it was first admitted through
    v = _join(f, crypto.new_key(), secret, token=t0, now=NOW + 2)  # a laundered key's token admits nobody
    assert not v.ok and "not a member" in v.reason


def test_a_member_that_mints_identities_cannot_lock_an_honest_member_out() -> None:
    """A member fills the 1024-node table with identities it signed offline (some of them admitting more
    of their own), buries an honest member's life, and the honest refutation used to be dropped as "a new node's
    record" (new joiners too). Now the members admitted through any one member are bounded (MAX_THROUGH) and a
    table takes back a node it knew: the honest member and a new joiner end up in the table."""
    from meshllm.proto.gossip import MAX_PEERS, MAX_THROUGH, Tombstone
    from meshllm.proto.record import MAX_RECORDS

    founder, honest, m = crypto.new_key(), crypto.new_key(), crypto.new_key()
    f = MeshCore(key=founder, mesh_id=crypto.mesh_id_for(crypto.node_id(founder)), chain=adm.found(founder, NOW - 60),
                 incarnation=1, now=0.0, wall=NOW)  # fmt: skip
    nh, nm = crypto.node_id(honest), crypto.node_id(m)
    chain_h = adm.admit(founder, f.chain, nh, NOW - 30)
    chain_m = adm.admit(founder, f.chain, nm, NOW - 30, tok.Scope.WORKER)
    _gossip_life(f, honest, chain_h, 1, 0.0, links={nm: "direct"})  # the member was connected to it: may bury it
    _gossip(f, m, chain_m, 1, 0.0)
    records = []
    by, by_chain = m, chain_m
    for i in range(MAX_PEERS + 100):
        s = crypto.new_key()
        chain = adm.admit(by, by_chain, crypto.node_id(s), NOW - 20, tok.Scope.WORKER)
        # one in ten admits the next itself: identities admitted down the line count against the member too
        by, by_chain = (s, chain) if i % 10 == 8 else (m, chain_m)
        records.append(PeerRecord(crypto.node_id(s), 1, 1, chain=tuple(chain), at=int(NOW)).to_wire(s))
    for i in range(0, len(records), MAX_RECORDS):
        f.on_message(nm, GossipPush(records=records[i : i + MAX_RECORDS]), 1.0)
    through_m = [n for n, e in f.table.entries.items() if nm in adm.lineage(e.record.chain)[:-1]]
    assert len(through_m) == MAX_THROUGH
    # the member buries the honest member's life; the honest member refutes it (a new life) and is taken back
    f.on_message(nm, GossipPush(tombstones=[Tombstone(nh, 1, nm, NOW).signed(m).to_wire()]), 2.0)
    _gossip_life(f, honest, chain_h, 2, 3.0, links={nm: "direct"})
    joiner = crypto.new_key()
    _gossip(f, joiner, adm.admit(founder, f.chain, crypto.node_id(joiner), NOW), 1, 3.0)
    assert nh in f.table.entries and f.table.entries[nh].record.incarnation == 2
    assert crypto.node_id(joiner) in f.table.entries
    # several members together fill the table (each within its share): a life buried then still comes back
    for _ in range(MAX_PEERS // MAX_THROUGH):
        k = crypto.new_key()
        ck = adm.admit(founder, f.chain, crypto.node_id(k), NOW - 30, tok.Scope.WORKER)
        _gossip(f, k, ck, 1, 4.0)
        batch = []
        for _ in range(MAX_THROUGH):
            s = crypto.new_key()
            c = adm.admit(k, ck, crypto.node_id(s), NOW - 20, tok.Scope.WORKER)
            batch.append(PeerRecord(crypto.node_id(s), 1, 1, chain=tuple(c), at=int(NOW)).to_wire(s))
        f.on_message(crypto.node_id(k), GossipPush(records=batch), 4.0)
    assert len(f.table.entries) == MAX_PEERS
    f.on_message(nm, GossipPush(tombstones=[Tombstone(nh, 2, nm, NOW).signed(m).to_wire()]), 5.0)
    assert nh not in f.table.entries
    k = crypto.new_key()  # the slot it left is taken at once
    ck = adm.admit(founder, f.chain, crypto.node_id(k), NOW - 30, tok.Scope.WORKER)
    _gossip(f, k, ck, 1, 5.0)
    assert len(f.table.entries) == MAX_PEERS
    _gossip_life(f, honest, chain_h, 3, 6.0)
    assert nh in f.table.entries and f.table.entries[nh].record.incarnation == 3


def _gossip_life(f: MeshCore, key: crypto.Ed25519PrivateKey, chain: list[adm.Link], inc: int, now: float,
                 links: dict[bytes, str] | None = None) -> None:  # fmt: skip
    rec = PeerRecord(crypto.node_id(key), inc, 1, chain=tuple(chain), at=int(NOW), links=links or {})
    f.on_message(crypto.node_id(key), GossipPush(records=[rec.to_wire(key)]), now)
