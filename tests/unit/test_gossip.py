"""Signed records, merge order, tombstones, liveness (virtual time)."""

from __future__ import annotations

import dataclasses

import pytest

from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.gossip import DEAD_AFTER_S, SUSPECT_AFTER_S, GossipPush, Liveness, Table, Tombstone
from meshllm.proto.record import PeerRecord, Role
from meshllm.proto.wire import pack, unpack

T = 1_800_000_000.0
FOUNDER = crypto.new_key()
CHAIN = adm.found(FOUNDER, T)
MESH = CHAIN[0][0]


def member() -> tuple[crypto.Ed25519PrivateKey, list[adm.Link]]:
    k = crypto.new_key()
    return k, adm.admit(FOUNDER, CHAIN, crypto.node_id(k), T)


def rec(key: crypto.Ed25519PrivateKey, chain: list[adm.Link], inc: int = 1, seq: int = 1, **kw: object) -> bytes:
    r = PeerRecord(node=crypto.node_id(key), incarnation=inc, seq=seq, chain=tuple(chain), **kw)  # type: ignore[arg-type]
    return r.to_wire(key)


def test_newer_records_win_older_ones_are_ignored() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, seq=2, state="ready"), T).changed == [n]
    assert t.merge_record(rec(k, c, seq=1, state="loading"), T).changed == []
    assert t.entries[n].record.state == "ready"
    assert t.merge_record(rec(k, c, inc=2, seq=0, state="serving"), T).changed == [n]
    assert t.entries[n].record.state == "serving"


def test_records_with_unknown_roles_or_states_are_dropped() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    assert "unknown value 'king'" in t.merge_record(rec(k, c, role="king"), T).dropped[0]
    assert "field state" in t.merge_record(rec(k, c, state="x" * 50), T).dropped[0]
    assert not t.entries
    assert t.merge_record(rec(k, c, role="client", state="ready"), T).changed == [crypto.node_id(k)]
    assert t.entries[crypto.node_id(k)].record.role is Role.CLIENT  # decoded into the enum


def test_forged_and_foreign_records_are_dropped() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    raw = rec(k, c)
    body, sig = unpack(raw)
    forged = pack([body.replace(b"starting", b"servingx"), sig])
    assert "bad signature" in t.merge_record(forged, T).dropped[0]
    outsider = crypto.new_key()
    foreign = rec(outsider, adm.found(outsider, T))
    assert "non-member" in t.merge_record(foreign, T).dropped[0]
    assert t.merge_record(b"\x93garbage", T).dropped and not t.entries


def test_tombstones_bury_a_life_and_a_new_life_comes_back() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    t.merge_record(rec(k, c, inc=3, seq=5), T)
    tomb = Tombstone(n, 3, crypto.node_id(FOUNDER), T).signed(FOUNDER)
    assert t.add_tombstone(tomb, T).changed == [n] and n not in t.entries
    assert t.merge_record(rec(k, c, inc=3, seq=99), T).changed == []  # an old life never returns
    assert t.merge_record(rec(k, c, inc=4, seq=0), T).changed == [n]


def test_a_tombstone_about_ourselves_is_refuted() -> None:
    k, _ = member()
    t = Table(crypto.node_id(k), MESH)
    assert t.add_tombstone(Tombstone(crypto.node_id(k), 1, crypto.node_id(FOUNDER), T).signed(FOUNDER), T).refuted


def test_a_clean_leave_buries_and_travels() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    t.merge_record(rec(k, c, seq=1), T)
    res = t.merge_record(rec(k, c, seq=2, left=True), T)
    assert crypto.node_id(k) not in t.entries and res.new_raw
    # not in the graveyard either: a node that left is not redialled ("connected to X" after "X left")
    assert crypto.node_id(k) not in t.graveyard
    t2 = Table(crypto.node_id(crypto.new_key()), MESH)
    t2.merge_push(t.push_all(), T)
    t2.merge_record(rec(k, c, seq=1), T)  # an old record arriving later is buried
    assert crypto.node_id(k) not in t2.entries


def test_liveness_follows_the_heartbeat() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    t.merge_record(rec(k, c), T)
    assert t.liveness(n, T + SUSPECT_AFTER_S - 0.1) is Liveness.ALIVE
    assert t.liveness(n, T + SUSPECT_AFTER_S) is Liveness.SUSPECT
    assert t.liveness(n, T + DEAD_AFTER_S) is Liveness.DEAD
    res = t.expire(FOUNDER, T + DEAD_AFTER_S)
    assert [x.node for x in res.new_tombstones] == [n] and n in t.graveyard
    push = t.push_all()
    assert isinstance(push, GossipPush) and len(push.tombstones) == 1
    assert dataclasses.replace(res.new_tombstones[0]).by == crypto.node_id(FOUNDER)


def test_rtts_and_links_are_keyed_by_node_id_and_other_keys_are_dropped() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    peer = crypto.node_id(crypto.new_key())
    rtt = {peer: 3.5, crypto.short(peer): 1.0, b"short": 2.0}  # the log's short id is not a key any more
    links = {peer: "direct", "x" * 8: "direct"}
    t.merge_record(rec(k, c, rtt_ms=rtt, links=links), T)
    r = t.entries[crypto.node_id(k)].record
    assert r.rtt_ms == {peer: 3.5} and r.links == {peer: "direct"}


def test_forged_tombstones_bury_nobody() -> None:
    """Audit finding 5: a tombstone signed by any key was taken and forwarded, and one for a life far ahead
    kept its node out for good. Now: the signer must be a known member, and only a life seen may be buried."""
    me = crypto.new_key()
    t = Table(crypto.node_id(me), MESH)
    t.my_incarnation = 1
    victim_key, vc = member()
    signer_key, sc = member()
    victim, signer = crypto.node_id(victim_key), crypto.node_id(signer_key)
    t.merge_record(rec(victim_key, vc, inc=1), T)
    t.merge_record(rec(signer_key, sc, inc=1), T)

    def push(tomb: Tombstone) -> list[str]:
        return t.merge_push(GossipPush(tombstones=[tomb.to_wire()]), T).dropped

    stranger = crypto.new_key()  # a valid signature, but no member's
    assert push(Tombstone(victim, 1, crypto.node_id(stranger), T).signed(stranger)) == [
        "tombstone signed by a node that is not a known member"
    ]
    far = Tombstone(victim, 2**62, signer, T).signed(signer_key)  # a member, but a life nobody has seen
    assert push(far) == ["tombstone for a life not seen yet"]
    unknown = crypto.node_id(crypto.new_key())
    assert push(Tombstone(unknown, 1, signer, T).signed(signer_key)) == ["tombstone for a node we do not know"]
    assert victim in t.entries and not t.tombstones  # nothing buried, nothing to forward
    # our own future life: not refuted (a refutation would follow the forger's number)
    res = t.merge_push(
        GossipPush(tombstones=[Tombstone(crypto.node_id(me), 2**62, signer, T).signed(signer_key).to_wire()]), T
    )
    assert not res.refuted and res.dropped == ["tombstone for a life of ours not being lived"]
    # a member may bury only a node it was connected to, as the node's own record says (ours: we say)
    assert push(Tombstone(victim, 1, signer, T).signed(signer_key)) == [
        "tombstone by a member the node was not connected to"] and victim in t.entries  # fmt: skip
    res = t.merge_push(GossipPush(tombstones=[Tombstone(crypto.node_id(me), 1, signer, T).signed(signer_key)
                                              .to_wire()]), T)  # fmt: skip
    assert not res.refuted and res.dropped == ["tombstone for us by a member not connected to us"]
    t.my_links = frozenset({signer})
    assert t.merge_push(GossipPush(tombstones=[Tombstone(crypto.node_id(me), 1, signer, T).signed(signer_key)
                                               .to_wire()]), T).refuted  # fmt: skip
    t.merge_record(rec(victim_key, vc, inc=1, seq=2, links={signer: "direct"}), T)
    # a member burying the current life of a node it was connected to still works (a real death); the next life
    # comes back
    assert push(Tombstone(victim, 1, signer, T).signed(signer_key)) == [] and victim not in t.entries
    assert t.merge_record(rec(victim_key, vc, inc=2), T).changed == [victim]


def test_a_multi_device_nodes_shares_travel_and_bad_ones_are_dropped() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, capacity=7, shares=(4, 3), device="cuda: 2× X"), T).changed == [n]
    assert t.entries[n].record.shares == (4, 3)
    assert "field shares" in t.merge_record(rec(k, c, seq=2, shares=("a",)), T).dropped[0]
    assert "field shares" in t.merge_record(rec(k, c, seq=3, shares=tuple(range(17))), T).dropped[0]
    assert t.entries[n].record.shares == (4, 3)
    assert t.merge_record(rec(k, c, seq=4, name="gpu-box"), T).changed == [n] and t.entries[n].record.name == "gpu-box"
    assert "field name" in t.merge_record(rec(k, c, seq=5, name="x" * 33), T).dropped[0]
    assert "field name" in t.merge_record(rec(k, c, seq=6, name="bell\a"), T).dropped[0]


def test_the_peer_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member minted 2000 identities of its own and every node accepted (and dialled) them all."""
    import meshllm.proto.gossip as g

    cap = 5
    monkeypatch.setattr(g, "MAX_PEERS", cap)
    t = Table(crypto.node_id(FOUNDER), MESH)
    members = [member() for _ in range(cap + 2)]
    results = [t.merge_record(rec(k, c), T) for k, c in members]
    assert len(t.entries) == cap
    assert "peer table full" in results[-1].dropped[0]
    k, c = members[0]
    assert t.merge_record(rec(k, c, seq=2), T).changed == [crypto.node_id(k)]  # known nodes still update


def test_a_revocation_cuts_the_member_and_everyone_it_admitted_for_good() -> None:
    """Membership could not be revoked: now the founder's signed word drops a member and its descendants
    from every table, their records and chains are refused from then on, and the word travels in gossip."""
    me = crypto.new_key()
    t = Table(crypto.node_id(me), MESH)
    b, cb = member()
    c = crypto.new_key()
    cc = adm.admit(b, cb, crypto.node_id(c), T)  # admitted by b
    d, cd = member()  # admitted by the founder
    for k, ch in ((b, cb), (c, cc), (d, cd)):
        t.merge_record(rec(k, ch), T)
    nb, nc, nd = (crypto.node_id(k) for k in (b, c, d))
    # only the founder revokes, and only others; a forged or altered revocation is refused
    with pytest.raises(ValueError, match="only the node that founded"):
        sgn.revoke(d, MESH, nb, T)
    with pytest.raises(ValueError, match="cannot revoke itself"):
        sgn.revoke(FOUNDER, MESH, crypto.node_id(FOUNDER), T)
    r = sgn.revoke(FOUNDER, MESH, nb, T)
    forged = dataclasses.replace(r, by=nd)
    altered = dataclasses.replace(r, node=nd)
    res = t.merge_push(GossipPush(revocations=[forged.to_wire(), altered.to_wire(), [1, 2]]), T)
    assert len(res.dropped) == 3 and not t.revoked and set(t.entries) == {nb, nc, nd}
    res = t.merge_push(GossipPush(revocations=[r.to_wire()]), T)
    assert set(res.cut) == {nb, nc} and set(t.entries) == {nd} and res.new_revocations == [r]
    assert t.scope_of(nb) is None and t.scope_of(nc) is None  # their tokens admit nobody now
    # newer records of theirs are refused; the word travels on to every new connection
    assert not t.merge_record(rec(b, cb, seq=9), T).changed and not t.merge_record(rec(c, cc, seq=9), T).changed
    assert t.push_all().revocations == [r.to_wire()]
    assert t.merge_push(GossipPush(revocations=[r.to_wire()]), T).new_revocations == []  # no news twice
    other = Table(nb, MESH)
    assert other.merge_push(GossipPush(revocations=[r.to_wire()]), T).revoked_me


def test_an_admin_the_founder_named_revokes_members_but_not_the_founder_or_other_admins() -> None:
    """Revocation "signed by the founder or a node it made admin": the founder's grant travels in gossip
    before the admin's revocations; an admin's word counts only while it stands."""
    t = Table(crypto.node_id(crypto.new_key()), MESH)
    (a, ca), (b, cb), (e, ce) = member(), member(), member()
    na, nb, ne = (crypto.node_id(k) for k in (a, b, e))
    for k, ch in ((a, ca), (b, cb), (e, ce)):
        t.merge_record(rec(k, ch), T)
    with pytest.raises(ValueError, match="only the node that founded"):
        sgn.grant_admin(a, MESH, nb, T)
    g, ge = sgn.grant_admin(FOUNDER, MESH, na, T), sgn.grant_admin(FOUNDER, MESH, ne, T)
    r = sgn.revoke(a, MESH, nb, T, admins={na})
    # before the grant is known, a's revocation is an outsider's; forged grants are refused
    res = t.merge_push(GossipPush(revocations=[r.to_wire()]), T)
    assert "only the node that founded the mesh, or an admin" in res.dropped[0] and not t.revoked
    forged = dataclasses.replace(sgn.grant_admin(FOUNDER, MESH, na, T), node=nb)
    assert "bad signature" in t.merge_push(GossipPush(admins=[forged.to_wire()]), T).dropped[0]
    res = t.merge_push(GossipPush(admins=[g.to_wire(), ge.to_wire()], revocations=[r.to_wire()]), T)
    assert res.cut == [nb] and set(t.admins) == {na, ne}
    assert {tuple(x) for x in t.push_all().admins} == {tuple(g.to_wire()), tuple(ge.to_wire())}
    # an admin revokes neither the founder nor another admin (made by hand, signed by a: refused where it arrives)
    for victim in (crypto.node_id(FOUNDER), ne):
        with pytest.raises(ValueError, match="cannot revoke the founder or another admin"):
            sgn.revoke(a, MESH, victim, T, admins={na, ne})
        bad = sgn.Revocation(MESH, victim, int(T), na)
        bad = dataclasses.replace(bad, sig=crypto.sign(a, crypto.D_REVOKE, bad.body()))
        assert "cannot revoke the founder" in t.merge_push(GossipPush(revocations=[bad.to_wire()]), T).dropped[0]
    # the founder revokes the admin: its word counts no more
    t.merge_push(GossipPush(revocations=[sgn.revoke(FOUNDER, MESH, na, T).to_wire()]), T)
    c, cc = member()
    t.merge_record(rec(c, cc), T)
    late = sgn.revoke(a, MESH, crypto.node_id(c), T, admins={na})
    assert t.merge_push(GossipPush(revocations=[late.to_wire()]), T).dropped and crypto.node_id(c) in t.entries
    # and what it revoked falls with it — a node that took a revocation by the admin before hearing
    # of the admin's own (one signed after it and backdated, say) keeps none of them
    assert nb not in t.revoked and set(t.revoked) == {na}
    assert t.merge_record(rec(b, cb, seq=2), T).changed == [nb]  # b is a member again
    t2 = Table(crypto.node_id(crypto.new_key()), MESH)
    t2.merge_record(rec(c, cc), T)
    t2.merge_push(GossipPush(admins=[g.to_wire()], revocations=[late.to_wire()]), T)
    assert crypto.node_id(c) in t2.revoked and crypto.node_id(c) not in t2.entries
    res = t2.merge_push(GossipPush(revocations=[sgn.revoke(FOUNDER, MESH, na, T).to_wire()]), T)
    assert res.voided == [crypto.node_id(c)] and set(t2.revoked) == {na}
    assert t2.merge_record(rec(c, cc, seq=2), T).changed == [crypto.node_id(c)]


def test_a_departed_nodes_old_record_does_not_come_back_after_its_tombstone_is_forgotten() -> None:
    """Low finding: once the tombstone of a node that left was forgotten (10 min), its last record replayed
    by anyone was taken as alive again. Records carry their signing time now; one older than MAX_RECORD_AGE_S is
    stale (a record of unknown time, from a core never told the wall clock, is not judged)."""
    from meshllm.proto.gossip import MAX_RECORD_AGE_S, TOMBSTONE_TTL_S

    t = Table(crypto.node_id(crypto.new_key()), MESH)
    k, ch = member()
    t.wall = T
    assert t.merge_record(rec(k, ch, at=int(T - 5)), T).changed  # a fresh one
    later = T + TOMBSTONE_TTL_S + 60
    t.wall = later
    res = t.merge_record(rec(k, ch, seq=2, at=int(T)), later)
    assert not res.changed and "stale" in res.dropped[0]
    assert t.merge_record(rec(k, ch, seq=3, at=int(later - MAX_RECORD_AGE_S + 30)), later).changed  # clocks apart
    # a record signed far in the future would never go stale (a ghost, once its node is gone)
    res = t.merge_record(rec(k, ch, seq=4, at=int(later + tok.CLOCK_SKEW_S + 60)), later)
    assert not res.changed and "in the future" in res.dropped[0]
    assert t.merge_record(rec(k, ch, seq=5, at=int(later + tok.CLOCK_SKEW_S - 60)), later).changed  # clocks apart


def test_addresses_from_peers_are_ip_literals_never_names() -> None:
    """A host name in a gossiped address was resolved on the event loop (a slow resolver held every
    node's loop for 8 s): records, tokens and every address a peer sends must be IP literals; the CLI resolves the
    user's own names once, at start."""
    import argparse

    import pytest

    from meshllm.cli.args import host_port
    from meshllm.net.endpoint import parse_addr, try_addr

    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    for field in ("addrs", "reflexive"):
        res = t.merge_record(rec(k, c, **{field: ("slow.resolver.example:4000",)}), T)
        assert res.changed == [] and "not an IP literal" in res.dropped[0], res.dropped
    assert t.merge_record(rec(k, c, addrs=("10.0.0.1:4000", "[fe80::1]:4000")), T).changed == [crypto.node_id(k)]
    assert try_addr("slow.resolver.example:4000") is None and try_addr("localhost:1") is None
    assert parse_addr("[::1]:7") == ("::1", 7) and parse_addr("10.1.2.3:7") == ("10.1.2.3", 7)
    for bad in ("1.2.3.4:0", "1.2.3.4:65536", "[::1:7", "::1", "1.2.3.4", "", "a" * 80):
        assert not tok.ip_port(bad), bad
    named = tok.mint(FOUNDER, MESH, b"s" * 32, ["slow.resolver.example:4000"], T, 60)
    with pytest.raises(tok.TokenError, match="malformed"):
        tok.parse(named.encode())
    assert host_port("localhost:4000") == "127.0.0.1:4000"  # the user's own name: resolved once, by the CLI
    with pytest.raises(argparse.ArgumentTypeError, match="cannot resolve"):
        host_port("no-such-host.invalid:4000")


def test_a_hosts_slots_travel_and_bad_ones_are_dropped() -> None:
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, slots=(3, 8, 2, 32768)), T).changed == [n]
    assert t.entries[n].record.slots == (3, 8, 2, 32768)
    assert "field slots" in t.merge_record(rec(k, c, seq=2, slots=(1, 2, 3)), T).dropped[0]  # type: ignore[arg-type]
    assert "field slots" in t.merge_record(rec(k, c, seq=3, slots=(-1, 8, 0, 0)), T).dropped[0]
    assert t.entries[n].record.slots == (3, 8, 2, 32768)


def test_a_hosts_layers_and_rate_travel_and_bad_ones_are_dropped() -> None:
    """The layers of the plan the host runs (a lite client plans nothing: it showed a serving worker as
    "standby") and its generation rate now."""
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, layers=((0, 6), (6, 12)), rate=41.5), T).changed == [n]
    assert t.entries[n].record.layers == ((0, 6), (6, 12)) and t.entries[n].record.rate == 41.5
    assert "field lyr" in t.merge_record(rec(k, c, seq=2, layers=((0, -1),)), T).dropped[0]
    assert "field lyr" in t.merge_record(rec(k, c, seq=3, layers=((0, 1, 2),)), T).dropped[0]  # type: ignore[arg-type]
    assert t.entries[n].record.layers == ((0, 6), (6, 12))
    for i, bad in enumerate((float("nan"), -1.0, 1e9)):  # a nonsense rate reads as 0, the record stays
        assert t.merge_record(rec(k, c, seq=4 + i, rate=bad), T).changed == [n]
        assert t.entries[n].record.rate == 0.0


def test_a_member_that_left_is_still_one_for_its_tokens_until_revoked_or_ended() -> None:
    """A token names several members so that it works while its issuer is away; the member a joiner
    reaches checks the issuer's scope, which it knew only while the issuer was in its table."""
    t = Table(crypto.node_id(FOUNDER), MESH)
    t.wall = T
    k, c = member()
    n = crypto.node_id(k)
    t.merge_record(rec(k, c), T)
    t.merge_record(rec(k, c, seq=2, left=True), T)
    assert n not in t.entries and t.scope_of(n) == tok.Scope.HOST and t.chain_of(n) == tuple(c)
    t.wall = adm.chain_until(c) + 1  # its admission ended: no longer
    assert t.scope_of(n) is None
    t.wall = T
    t.add_revocation(sgn.revoke(FOUNDER, MESH, n, T))  # revoked: no longer
    assert t.scope_of(n) is None and t.chain_of(n) is None
    assert t.scope_of(b"\x01" * 32) is None  # never a member


def test_a_partial_copy_says_which_layers_it_holds_and_is_never_elected_host() -> None:
    """A worker that fetched only its layers names them in its record ("held"; absent: the whole file); a
    bad list drops the record; the election passes over a partial copy however much memory it offers (a host needs
    the whole file)."""
    from meshllm.proto.meshcore import _elect
    from meshllm.proto.record import ModelFacts, Role

    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, held=((0, 6), (9, 2))), T).changed == [n]
    assert t.entries[n].record.held == ((0, 6), (9, 2)) and not t.entries[n].record.whole
    assert t.merge_record(rec(k, c, seq=2, held=()), T).changed == [n]  # holds no layer yet: still partial
    assert t.entries[n].record.held == ()
    assert "field held" in t.merge_record(rec(k, c, seq=3, held=((0, -1),)), T).dropped[0]
    assert t.merge_record(rec(k, c, seq=4), T).changed == [n] and t.entries[n].record.whole
    facts = ModelFacts("ab" * 32, 1, 1, "m")
    k2, c2 = member()
    whole = PeerRecord(crypto.node_id(k2), 1, 1, Role.WORKER, capacity=10, model=facts, chain=tuple(c2))
    big = PeerRecord(n, 1, 1, Role.WORKER, capacity=100, model=facts, chain=tuple(c), held=((0, 1),))
    assert _elect([whole, big], facts.fingerprint) == whole.node
    assert _elect([big], facts.fingerprint) is None
    assert _elect([whole, dataclasses.replace(big, held=None)], facts.fingerprint) == n


def test_a_replica_says_so_in_its_record() -> None:
    """A host beside the elected one says it is a replica ("rep"; absent: not one)."""
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, role="host", replica=True), T).changed == [n]
    assert t.entries[n].record.replica
    assert t.merge_record(rec(k, c, seq=2, role="host"), T).changed == [n] and not t.entries[n].record.replica


def test_a_record_whose_model_fingerprint_is_not_64_hex_digits_is_dropped() -> None:
    """A member's record named its model ``../../x`` and a joining node wrote ``<any path>.part``."""
    from meshllm.proto.record import ModelFacts

    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    for i, fp in enumerate(["../../../../tmp/owned" + "0" * 43, "AB" * 32, "ab" * 31, "/" + "a" * 63], 1):
        got = t.merge_record(rec(k, c, seq=i, model=ModelFacts(fp, 1, 1, "m")), T)
        assert got.changed == [] and "fingerprint" in got.dropped[0], fp
    assert t.merge_record(rec(k, c, seq=9, model=ModelFacts("ab" * 32, 1, 1, "m")), T).changed == [n]


def test_a_connected_peer_that_falls_silent_is_buried_after_direct_dead_s_not_dead_after_s() -> None:
    """(the mutation audit left it untested): a node we are connected to that says nothing for
    DIRECT_DEAD_S (6 s) is buried by us at once — a member that did not hear it for DEAD_AFTER_S (10 s) is slower."""
    from meshllm.proto.meshcore import DIRECT_DEAD_S, MeshCore

    k, c = member()
    t0 = 100.0
    a = MeshCore(FOUNDER, MESH, CHAIN, 1, t0)
    b = MeshCore(k, MESH, c, 1, t0)
    n = crypto.node_id(k)
    for dst, (_, msg) in ((a, x) for x in b.on_connected(a.me, t0)):
        dst.on_message(n, msg, t0)
    a.on_connected(n, t0)
    assert n in {r.node for r in a.alive(t0)}
    a.tick(t0 + DIRECT_DEAD_S - 0.5)
    assert n in {r.node for r in a.alive(t0 + DIRECT_DEAD_S - 0.5)}
    a.tick(t0 + DIRECT_DEAD_S + 0.1)
    assert DIRECT_DEAD_S + 0.1 < DEAD_AFTER_S and n not in a.table.entries and n in a.table.tombstones


def test_the_ram_a_node_offers_travels_and_a_bad_one_is_dropped() -> None:
    """The RAM beside a node's capacity is in its record (absent: 0, an older node's)."""
    t = Table(crypto.node_id(FOUNDER), MESH)
    k, c = member()
    n = crypto.node_id(k)
    assert t.merge_record(rec(k, c, capacity=5, ram=7 * 2**30), T).changed == [n]
    assert t.entries[n].record.ram == 7 * 2**30
    assert "field ram" in t.merge_record(rec(k, c, seq=2, ram=-1), T).dropped[0]
    assert t.merge_record(rec(k, c, seq=3), T).changed == [n] and t.entries[n].record.ram == 0
