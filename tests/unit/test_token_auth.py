"""Invite tokens, admission chains and the auth handshake (virtual time)."""

from __future__ import annotations

import base64
import os
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.auth import AuthChallenge, AuthHello, check_proof, make_proof

NOW = 1_800_000_000.0


@pytest.fixture
def mesh() -> dict[str, object]:
    founder = crypto.new_key()
    chain = adm.found(founder, NOW)
    return {"key": founder, "chain": chain, "mesh_id": chain[0][0], "secret": os.urandom(32)}


def _token(m: dict[str, object], now: float = NOW, ttl: float = 3600) -> tok.Token:
    return tok.mint(m["key"], m["mesh_id"], m["secret"], ["127.0.0.1:1"], now, ttl)  # type: ignore[arg-type]


def test_token_round_trip_and_checks(mesh: dict[str, object]) -> None:
    t = _token(mesh)
    text = t.encode()
    assert text.startswith("mesh1.") and tok.parse(text) == t
    assert tok.check(tok.parse(text), NOW, mesh["mesh_id"]) == t  # type: ignore[arg-type]
    with pytest.raises(tok.TokenError, match="expired") as e:
        tok.check(t, NOW + 3601)
    assert e.value.reason == "expired"
    with pytest.raises(tok.TokenError) as e:
        tok.check(t, NOW, mesh_id=b"x" * 16)
    assert e.value.reason == "wrong-mesh"
    # re-encoding an expired token with a later expiry breaks the signature
    with pytest.raises(tok.TokenError) as e:
        tok.check(replace(t, expires=int(NOW + 10**6)), NOW + 3601)
    assert e.value.reason == "signature"
    assert str(mesh["secret"]) not in t.redacted() and text not in t.redacted()


@pytest.mark.parametrize("text", ["", "mesh1.", "mesh1.!!!!", "hello", "mesh1." + "A" * 5000, "mesh1.kQE"])
def test_malformed_tokens(text: str) -> None:
    with pytest.raises(tok.TokenError) as e:
        tok.parse(text)
    assert e.value.reason == "malformed"


def test_every_flipped_character_is_refused(mesh: dict[str, object]) -> None:
    text = _token(mesh).encode()
    for i in range(len("mesh1."), len(text)):
        c = "A" if text[i] != "A" else "B"
        bad = text[:i] + c + text[i + 1 :]
        try:
            tok.check(tok.parse(bad), NOW)
        except tok.TokenError:
            continue
        # base64 padding bits may be flipped without changing the bytes
        assert tok.parse(bad) == tok.parse(text)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: "mesh1." + b.hex()))
def test_parse_gives_a_token_or_a_token_error(text: str) -> None:
    try:
        t = tok.parse(text)
    except tok.TokenError:
        return
    assert isinstance(t, tok.Token)


def test_admission_chains(mesh: dict[str, object]) -> None:
    key, chain, mid = mesh["key"], mesh["chain"], mesh["mesh_id"]
    founder = crypto.node_id(key)  # type: ignore[arg-type]
    assert adm.verify_chain(chain, founder, mid) is None  # type: ignore[arg-type]
    a = crypto.new_key()
    ca = adm.admit(key, chain, crypto.node_id(a), NOW)  # type: ignore[arg-type]
    b = crypto.new_key()
    cb = adm.admit(a, ca, crypto.node_id(b), NOW)
    assert adm.verify_chain(cb, crypto.node_id(b), mid) is None  # type: ignore[arg-type]
    assert adm.verify_chain(cb, crypto.node_id(a), mid) == "chain admits another node"  # type: ignore[arg-type]
    assert "another mesh" in (adm.verify_chain(cb, crypto.node_id(b), b"y" * 16) or "")
    # an outsider cannot start its own chain in this mesh, nor sign a link it was not given
    outsider = crypto.new_key()
    fake = adm.admit(outsider, adm.found(outsider, NOW), crypto.node_id(b), NOW)
    assert adm.verify_chain(fake, crypto.node_id(b), mid) is not None  # type: ignore[arg-type]
    forged = [*chain, (mid, crypto.node_id(b), founder, int(NOW), int(NOW) + 60, 2, b"\0" * 64, ())]  # type: ignore[misc]
    assert "bad signature" in (adm.verify_chain(forged, crypto.node_id(b), mid) or "")  # type: ignore[arg-type]
    assert adm.verify_chain(adm.chain_from_wire(adm.chain_to_wire(cb)), crypto.node_id(b), mid) is None  # type: ignore[arg-type]


def _handshake(
    mesh: dict[str, object],
    dialler: crypto.Ed25519PrivateKey,
    *,
    secret: bytes | None = None,
    token: tok.Token | None = None,
    chain: list[adm.Link] | None = None,
    now: float = NOW,
    nonce: bytes | None = None,
    proof_nonce: bytes | None = None,
    members: dict[bytes, tok.Scope] | None = None,
    listener_chain: list[adm.Link] | None = None,
    listener_key: crypto.Ed25519PrivateKey | None = None,
    revoked: set[bytes] | None = None,
    previous: list[bytes] | None = None,
    in_touch: bool = True,
) -> tuple[bool, str]:
    lkey = listener_key or mesh["key"]
    listener = crypto.node_id(lkey)  # type: ignore[arg-type]
    known = members or {}
    hello = AuthHello(dialler=crypto.node_id(dialler), listener=listener, mesh_id=mesh["mesh_id"])  # type: ignore[arg-type]
    nonce = nonce or os.urandom(32)
    proof = make_proof(
        dialler,
        secret or mesh["secret"],
        AuthChallenge(proof_nonce or nonce),
        listener,
        chain=chain,
        token=token,  # type: ignore[arg-type]
    )
    v = check_proof(
        key=lkey, my_chain=listener_chain or mesh["chain"], mesh_id=mesh["mesh_id"], secret=mesh["secret"],  # type: ignore[arg-type]
        hello=hello, nonce=nonce, proof=proof, scope_of=known.get, revoked=revoked or set(),
        previous=previous or [], now=now, in_touch=in_touch,
    )  # fmt: skip
    if v.ok:
        assert v.chain is not None
        assert adm.verify_chain(v.chain, crypto.node_id(dialler), mesh["mesh_id"]) is None  # type: ignore[arg-type]
    return v.ok, v.reason


def test_joiner_with_a_valid_token_is_admitted(mesh: dict[str, object]) -> None:
    ok, why = _handshake(mesh, crypto.new_key(), token=_token(mesh))
    assert ok, why


def test_member_with_its_chain_is_accepted(mesh: dict[str, object]) -> None:
    a = crypto.new_key()
    ca = adm.admit(mesh["key"], mesh["chain"], crypto.node_id(a), NOW)  # type: ignore[arg-type]
    assert _handshake(mesh, a, chain=ca)[0]
    b = crypto.new_key()
    assert _handshake(mesh, b, chain=ca)[1].startswith("not a member")  # someone else's chain


def test_refusals(mesh: dict[str, object]) -> None:
    joiner = crypto.new_key()
    good = _token(mesh)
    # a tampered token (another address)
    assert "signature" in _handshake(mesh, joiner, token=replace(good, addrs=("10.0.0.1:1",)))[1]
    # a well-formed token signed by a non-member, with the right mesh id and secret
    outsider = crypto.new_key()
    alien = tok.mint(outsider, mesh["mesh_id"], mesh["secret"], [], NOW, 3600)  # type: ignore[arg-type]
    assert "not a member" in _handshake(mesh, joiner, token=alien)[1]
    # ... which becomes acceptable once its issuer is a member
    assert _handshake(mesh, joiner, token=alien, members={crypto.node_id(outsider): tok.Scope.HOST})[0]
    # the right token, a wrong secret
    assert "secret proof invalid" in _handshake(mesh, joiner, token=good, secret=os.urandom(32))[1]
    # a proof captured on one connection, replayed on another (new nonce)
    assert "replayed" in _handshake(mesh, joiner, token=good, proof_nonce=os.urandom(32))[1]
    # an expired token re-encoded with a later expiry
    old = _token(mesh, now=NOW - 7200, ttl=60)
    assert "signature" in _handshake(mesh, joiner, token=replace(old, expires=int(NOW + 3600)))[1]
    # simply expired
    assert "expired" in _handshake(mesh, joiner, token=old)[1]
    # nothing at all
    assert not _handshake(mesh, joiner)[0]


def test_scopes_narrow_along_the_chain_and_bound_what_a_token_admits(mesh: dict[str, object]) -> None:
    """Scopes: a token admits its holder with the token's scope; nobody admits or mints wider than itself."""
    key, chain, mid = mesh["key"], mesh["chain"], mesh["mesh_id"]
    assert adm.chain_scope(chain) == tok.Scope.HOST  # type: ignore[arg-type]
    # a worker token from the founder: the joiner's chain says worker
    w = crypto.new_key()
    t = tok.mint(key, mid, mesh["secret"], [], NOW, 3600, tok.Scope.WORKER)  # type: ignore[arg-type]
    assert tok.parse(t.encode()).scope == tok.Scope.WORKER and "scope worker" in t.redacted()
    ok, why = _handshake(mesh, w, token=t)
    assert ok and why == "joined with a worker token"
    cw = adm.admit(key, chain, crypto.node_id(w), NOW, tok.Scope.WORKER)  # type: ignore[arg-type]
    assert adm.chain_scope(cw) == tok.Scope.WORKER
    # the worker cannot admit a host: admit() refuses, and a link it forges anyway breaks the chain
    h = crypto.new_key()
    with pytest.raises(ValueError, match="cannot admit"):
        adm.admit(w, cw, crypto.node_id(h), NOW, tok.Scope.HOST)
    wider = [*cw, adm._link(w, mid, crypto.node_id(h), int(NOW), int(NOW) + 60, tok.Scope.HOST)]  # type: ignore[arg-type]
    assert "wider than its signer's" in (adm.verify_chain(wider, crypto.node_id(h), mid) or "")  # type: ignore[arg-type]
    narrower = [*cw, adm._link(w, mid, crypto.node_id(h), int(NOW), int(NOW) + 60, tok.Scope.CLIENT)]  # type: ignore[arg-type]
    assert adm.verify_chain(narrower, crypto.node_id(h), mid) is None  # type: ignore[arg-type]
    # a link's scope altered after signing
    m0, n0, b0, at0, u0, _, sig0, via0 = cw[-1]
    assert "bad signature" in (adm.verify_chain([*chain, (m0, n0, b0, at0, u0, 2, sig0, via0)], n0, mid) or "")  # type: ignore[arg-type, list-item]
    # a host token minted by the worker (its own key, the real secret): refused by the founder
    host_t = tok.mint(w, mid, mesh["secret"], [], NOW, 3600, tok.Scope.HOST)  # type: ignore[arg-type]
    why = _handshake(mesh, h, token=host_t, members={crypto.node_id(w): tok.Scope.WORKER})[1]
    assert "wider than its issuer's (worker)" in why
    # a worker listener asked to admit with the founder's host token: it cannot sign that link
    why = _handshake(mesh, h, token=_token(mesh), listener_key=w, listener_chain=cw,
                     members={crypto.node_id(key): tok.Scope.HOST})[1]  # type: ignore[arg-type]  # fmt: skip
    assert "worker-scoped and cannot admit a host" in why


def test_token_lifetimes_are_capped(mesh: dict[str, object]) -> None:
    """A 100-year token was accepted once: no token lives past MAX_TTL_S, even one made by hand."""
    with pytest.raises(ValueError, match="at most 30 days"):
        tok.mint(mesh["key"], mesh["mesh_id"], mesh["secret"], [], NOW, 100 * 365 * 86400)  # type: ignore[arg-type]
    t = tok.mint(mesh["key"], mesh["mesh_id"], mesh["secret"], [], NOW, tok.MAX_TTL_S)  # type: ignore[arg-type]
    assert tok.check(t, NOW) == t
    forever = replace(t, expires=int(NOW + 100 * 365 * 86400)).signed_by(mesh["key"])  # type: ignore[arg-type]
    with pytest.raises(tok.TokenError, match="-day limit"):
        tok.check(forever, NOW)
    assert "-day limit" in _handshake(mesh, crypto.new_key(), token=forever)[1]


def test_a_token_of_the_old_layout_says_so() -> None:
    from meshllm.proto.wire import pack

    old = (
        "mesh1."
        + __import__("base64").urlsafe_b64encode(pack([1, b"m" * 16, b"s" * 32, b"i" * 32, [], 1, b"x" * 64])).decode()
    )
    with pytest.raises(tok.TokenError, match="older mesh-llm"):
        tok.parse(old)


def test_a_revoked_node_is_refused_with_its_chain_a_token_or_a_chain_it_signed(mesh: dict[str, object]) -> None:
    key, chain = mesh["key"], mesh["chain"]
    b, c = crypto.new_key(), crypto.new_key()
    cb = adm.admit(key, chain, crypto.node_id(b), NOW)  # type: ignore[arg-type]
    cc = adm.admit(b, cb, crypto.node_id(c), NOW)
    revoked = {crypto.node_id(b)}
    assert _handshake(mesh, b, chain=cb)[0] and _handshake(mesh, c, chain=cc)[0]
    assert "revoked" in _handshake(mesh, b, chain=cb, revoked=revoked)[1]
    assert "whom the mesh revoked" in _handshake(mesh, c, chain=cc, revoked=revoked)[1]
    assert "revoked" in _handshake(mesh, b, token=_token(mesh), revoked=revoked)[1]  # a fresh token, the same key


def test_a_rotated_secret_refuses_old_tokens_and_keeps_members(mesh: dict[str, object]) -> None:
    """`mesh-llm rotate`: only the founder signs a new secret; tokens of the old one admit nobody; a member
    that missed the rotation still gets in with the old secret (and then learns the new one)."""
    from meshllm.proto.auth import make_rekey, rekey_refused

    key, mid, old = mesh["key"], mesh["mesh_id"], mesh["secret"]
    member = crypto.new_key()
    with pytest.raises(ValueError, match="only the node that founded"):
        make_rekey(member, mid, 1, os.urandom(32))  # type: ignore[arg-type]
    r = make_rekey(key, mid, 1, os.urandom(32))  # type: ignore[arg-type]
    assert rekey_refused(r, mid) is None  # type: ignore[arg-type]
    assert "bad signature" in (rekey_refused(replace(r, secret=os.urandom(32)), mid) or "")  # type: ignore[arg-type]
    assert "founder" in (rekey_refused(replace(r, by=crypto.node_id(member)), mid) or "")  # type: ignore[arg-type]
    old_token = _token(mesh)
    rotated = {**mesh, "secret": r.secret}
    assert "secret" in _handshake(rotated, crypto.new_key(), token=old_token)[1]
    fresh = tok.mint(key, mid, r.secret, [], NOW, 3600)  # type: ignore[arg-type]
    assert _handshake(rotated, crypto.new_key(), token=fresh)[0]
    cm = adm.admit(key, mesh["chain"], crypto.node_id(member), NOW)  # type: ignore[arg-type]
    # the member proves with the old secret: refused unless the listener keeps it among the previous ones
    assert "secret proof invalid" in _handshake(rotated, member, chain=cm, secret=old)[1]  # type: ignore[arg-type]
    assert _handshake(rotated, member, chain=cm, secret=old, previous=[old])[0]  # type: ignore[list-item]
    # ... but an old token never gets in that way
    assert not _handshake(rotated, crypto.new_key(), token=old_token, previous=[old])[0]  # type: ignore[list-item]


def test_an_admission_ends_unless_renewed(mesh: dict[str, object]) -> None:
    """Audit finding 4: a node admitted with a 1-second token still authenticated years later. An admission
    now holds for its span, a chain no longer than its shortest link, and nobody signs past their own end."""
    key, chain, mid = mesh["key"], mesh["chain"], mesh["mesh_id"]
    a, b, s = crypto.new_key(), crypto.new_key(), crypto.new_key()
    na, nb = crypto.node_id(a), crypto.node_id(b)
    ca = adm.admit(key, chain, na, NOW, ttl_s=100)  # type: ignore[arg-type]
    assert adm.verify_chain(ca, na, mid, NOW + 99) is None  # type: ignore[arg-type]
    assert "admission expired" in (adm.verify_chain(ca, na, mid, NOW + 100) or "")  # type: ignore[arg-type]
    assert _handshake(mesh, a, chain=ca, now=NOW + 50)[0]
    ok, why = _handshake(mesh, a, chain=ca, now=NOW + 101)
    assert not ok and "admission expired" in why
    assert not adm.needs_renewal(ca, NOW + 49) and adm.needs_renewal(ca, NOW + 50)
    assert not adm.needs_renewal(chain, NOW + 10**9)  # type: ignore[arg-type]  # the founder's own never ends
    # b admitted by a for 1000 s holds only as long as a does
    cb = adm.admit(a, ca, nb, NOW + 10, ttl_s=1000)
    assert adm.chain_until(cb) == NOW + 100
    assert not _handshake(mesh, b, chain=cb, now=NOW + 150)[0]
    # a, out since NOW + 100, signs a link dated back into its span: it ends with a's
    backdated = [*ca, adm._link(a, mid, crypto.node_id(s), int(NOW + 99), int(NOW + 99 + tok.MAX_ADMIT_S),  # type: ignore[arg-type]
                                tok.Scope.HOST)]  # fmt: skip
    assert "admission expired" in (adm.verify_chain(backdated, crypto.node_id(s), mid, NOW + 200) or "")  # type: ignore[arg-type]
    # a link signed after its signer's end, or one longer than the cap, is refused whatever the time
    late = [*ca, adm._link(a, mid, crypto.node_id(s), int(NOW + 150), int(NOW + 160), tok.Scope.HOST)]  # type: ignore[arg-type]
    assert "not in force" in (adm.verify_chain(late, crypto.node_id(s), mid) or "")  # type: ignore[arg-type]
    long = [*chain, adm._link(key, mid, na, int(NOW), int(NOW + tok.MAX_ADMIT_S + 1), tok.Scope.HOST)]  # type: ignore[arg-type, list-item]
    assert "holds longer" in (adm.verify_chain(long, na, mid) or "")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most"):
        adm.admit(key, chain, na, NOW, ttl_s=tok.MAX_ADMIT_S + 1)  # type: ignore[arg-type]
    # a joiner admitted by a member whose own admission ended is refused by that member
    ok, why = _handshake(mesh, s, token=tok.mint(a, mid, mesh["secret"], [], NOW + 101, 60), listener_key=a,  # type: ignore[arg-type]
                         listener_chain=ca, members={crypto.node_id(key): tok.Scope.HOST}, now=NOW + 101)  # type: ignore[arg-type]  # fmt: skip
    assert not ok and "own admission has ended" in why


def test_renewal_is_for_members_in_good_standing(mesh: dict[str, object]) -> None:
    key, chain, mid = mesh["key"], mesh["chain"], mesh["mesh_id"]
    a, b = crypto.new_key(), crypto.new_key()
    na, nb = crypto.node_id(a), crypto.node_id(b)
    ca = adm.admit(key, chain, na, NOW, ttl_s=100)  # type: ignore[arg-type]
    cb = adm.admit(a, ca, nb, NOW, ttl_s=100, scope=tok.Scope.WORKER)
    renewed = adm.renew(key, chain, nb, cb, mid, set(), NOW + 60, ttl_s=100)  # type: ignore[arg-type]
    assert adm.chain_until(renewed) == NOW + 160 and len(renewed) == 2  # the founder's renewal: a shorter chain
    assert adm.chain_scope(renewed) == tok.Scope.WORKER  # the scope it had, never wider
    with pytest.raises(ValueError, match="revoked"):
        adm.renew(key, chain, nb, cb, mid, {na}, NOW + 60)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="admission expired"):
        adm.renew(key, chain, nb, cb, mid, set(), NOW + 100)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ends sooner"):  # a cannot make b's admission last beyond its own
        adm.renew(a, ca, nb, renewed, mid, set(), NOW + 115)
    # not before half time, and who admitted b first stays on record: revoking a still cuts b
    with pytest.raises(ValueError, match="less than half"):
        adm.renew(key, chain, nb, cb, mid, set(), NOW + 39)  # type: ignore[arg-type]  (half is 50; a tenth of slack)
    assert renewed[-1][7] == (na,) and adm.lineage(renewed) == [na, nb]
    assert adm.cut_off(renewed, {na}) == na and adm.cut_off(renewed, set()) is None
    assert adm.verify_chain(adm.chain_from_wire(adm.chain_to_wire(renewed)), nb, mid) is None  # type: ignore[arg-type]
    stripped = [*renewed[:-1], (*renewed[-1][:7], ())]  # the provenance cut out of the founder's signed link
    assert "bad signature" in (adm.verify_chain(stripped, nb, mid) or "")  # type: ignore[arg-type]
    again = adm.renew(key, chain, nb, renewed, mid, set(), NOW + 110, ttl_s=100)  # type: ignore[arg-type]
    assert again[-1][7] == (na,)  # kept through every later renewal
    assert adm.better_renewer(chain) > adm.better_renewer(ca)  # type: ignore[arg-type]


def test_members_renew_through_the_core_and_one_left_unrenewed_is_dropped(mesh: dict[str, object]) -> None:
    """Two MeshCores (the founder and a member admitted for 100 s) exchange what they return: the member asks at
    half time and takes the renewal; a third member nobody renews is dropped from the founder's table at its end."""
    from meshllm.proto.gossip import GossipPush
    from meshllm.proto.meshcore import EventKind, MeshCore

    key, chain, mid = mesh["key"], mesh["chain"], mesh["mesh_id"]
    a, c = crypto.new_key(), crypto.new_key()
    na, nc, nf = crypto.node_id(a), crypto.node_id(c), crypto.node_id(key)  # type: ignore[arg-type]
    f_core = MeshCore(key=key, mesh_id=mid, chain=chain, incarnation=1, now=0.0, admit_s=100)  # type: ignore[arg-type]
    a_core = MeshCore(key=a, mesh_id=mid, chain=adm.admit(key, chain, na, NOW, ttl_s=100), incarnation=1, now=0.0)  # type: ignore[arg-type]
    c_core = MeshCore(key=c, mesh_id=mid, chain=adm.admit(key, chain, nc, NOW, ttl_s=100), incarnation=1, now=0.0)  # type: ignore[arg-type]
    cores = {nf: f_core, na: a_core}

    def deliver(sender: bytes, out: list[tuple[bytes, object]], now: float) -> None:
        for peer, msg in out:
            if peer in cores:
                deliver(peer, cores[peer].on_message(sender, msg, now), now)  # type: ignore[arg-type]

    deliver(nf, f_core.on_connected(na, 0.0), 0.0)
    deliver(na, a_core.on_connected(nf, 0.0), 0.0)
    f_core.on_message(nc, GossipPush(records=[c_core.record.to_wire(c)]), 0.0)
    assert {na, nc} <= set(f_core.table.entries)
    assert not [m for _, m in a_core.tick(1.0, NOW + 10)]  # not half over: nothing asked
    deliver(nf, f_core.tick(1.5, NOW + 54), 1.5)  # the founder renews by its own clock
    deliver(na, a_core.tick(2.0, NOW + 55), 2.0)
    assert adm.chain_until(a_core.chain) == NOW + 154 and len(a_core.chain) == 2
    assert any(e.kind == EventKind.RENEWED for e in a_core.events)
    assert f_core.table.entries[na].record.chain == tuple(a_core.chain)  # its new record reached the founder
    f_core.tick(3.0, NOW + 101)
    assert nc not in f_core.table.entries and na in f_core.table.entries
    assert any(e.kind == EventKind.EXPIRED and e.node == nc for e in f_core.events)
    # c's record offered again after its end is refused
    dropped = f_core.table.merge_push(GossipPush(records=[c_core.record.to_wire(c)]), 4.0).dropped
    assert nc not in f_core.table.entries and "admission expired" in dropped[0]
    c_core.tick(5.0, NOW + 101)
    assert any(e.kind == EventKind.EXPIRED and e.node == nc for e in c_core.events)  # it knows it is out


def test_a_node_cut_off_with_the_member_that_admitted_it_knows_it_is_out(mesh: dict[str, object]) -> None:
    """A revoked node (or one admitted through it) kept dialling for ever: a refusal now names the signed
    revocation (the dialler checks it itself), and a core that takes it says it is out, once."""
    from meshllm.proto.meshcore import EventKind, MeshCore

    key, chain, mid = mesh["key"], mesh["chain"], mesh["mesh_id"]
    b, c = crypto.new_key(), crypto.new_key()
    cb = adm.admit(key, chain, crypto.node_id(b), NOW)  # type: ignore[arg-type]
    cc = adm.admit(b, cb, crypto.node_id(c), NOW)
    r = sgn.revoke(key, mid, crypto.node_id(b), NOW)  # type: ignore[arg-type]
    hello = AuthHello(dialler=crypto.node_id(c), listener=crypto.node_id(key), mesh_id=mid)  # type: ignore[arg-type]
    v = check_proof(key=key, my_chain=chain, mesh_id=mid, secret=mesh["secret"], hello=hello, nonce=b"n" * 32,  # type: ignore[arg-type]
                    proof=make_proof(c, mesh["secret"], AuthChallenge(b"n" * 32), crypto.node_id(key), chain=cc),  # type: ignore[arg-type]
                    scope_of=lambda n: None, revoked={crypto.node_id(b)}, now=NOW)  # fmt: skip
    assert not v.ok and v.revoked == crypto.node_id(b)
    core = MeshCore(key=c, mesh_id=mid, chain=cc, incarnation=1, now=0.0)  # type: ignore[arg-type]
    core.revoke([r], 1.0)
    core.revoke([r], 2.0)
    assert [e for e in core.events if e.kind == EventKind.REVOKED and e.node == crypto.node_id(c)] != []
    assert len([e for e in core.events if e.node == crypto.node_id(c)]) == 1


def test_a_token_names_other_members_and_their_list_is_signed(mesh: dict[str, object]) -> None:
    """A token carried one issuer's addresses; when that member was away (a restart, a laptop shut), a
    joiner had no one to ask. It now names up to MAX_ALSO others, each with its addresses, under the signature."""
    others = [(bytes([i]) * 32, [f"10.0.0.{i}:4000", "bad address", f"[fd00::{i}]:4000"]) for i in range(1, 7)]
    me = crypto.node_id(mesh["key"])  # type: ignore[arg-type]
    t = tok.mint(mesh["key"], mesh["mesh_id"], mesh["secret"], ["127.0.0.1:1"], NOW, 3600,  # type: ignore[arg-type]
                 also=[(me, ["127.0.0.1:1"]), (bytes([9]) * 32, []), *others])  # fmt: skip
    assert [n for n, _ in t.also] == [o[0] for o in others[: tok.MAX_ALSO]]  # not itself, none without an address
    assert t.also[0][1] == ("10.0.0.1:4000", "[fd00::1]:4000")
    got = tok.check(tok.parse(t.encode()), NOW, mesh["mesh_id"])  # type: ignore[arg-type]
    assert got == t and got.members()[0] == (me, ["127.0.0.1:1"]) and len(got.members()) == 1 + tok.MAX_ALSO
    assert _handshake(mesh, crypto.new_key(), token=got)[0]  # checked by any member, the list included
    # the list is under the signature: swapping a member's id or address is refused
    for forged in (replace(t, also=((bytes([8]) * 32, ("10.0.0.1:4000",)), *t.also[1:])), replace(t, also=())):
        with pytest.raises(tok.TokenError, match="signature"):
            tok.check(tok.parse(forged.encode()), NOW)
    # a token naming nobody else is byte for byte the old layout (older nodes read it)
    plain = _token(mesh)
    b64 = plain.encode().removeprefix(tok.TOKEN_PREFIX)
    assert plain.also == () and len(msgpack.unpackb(base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)))) == 8


def test_the_founders_token_is_checked_by_a_member_that_never_saw_the_founder(mesh: dict[str, object]) -> None:
    """A founder is a member for good (every chain starts with its link): its token admits through any member, even
    one that joined while it was away (before, "token issuer … is not a member of this mesh")."""
    lkey = crypto.new_key()
    lchain = adm.admit(mesh["key"], mesh["chain"], crypto.node_id(lkey), NOW)  # type: ignore[arg-type]
    ok, why = _handshake(mesh, crypto.new_key(), token=_token(mesh), members={}, listener_chain=lchain,
                         listener_key=lkey)  # fmt: skip
    assert ok, why
    # another member's token still needs its issuer known to the one checking it
    other = crypto.new_key()
    ochain = adm.admit(mesh["key"], mesh["chain"], crypto.node_id(other), NOW)  # type: ignore[arg-type]
    theirs = tok.mint(other, mesh["mesh_id"], mesh["secret"], ["127.0.0.1:1"], NOW, 60)  # type: ignore[arg-type]
    ok, why = _handshake(mesh, crypto.new_key(), token=theirs, members={}, listener_chain=lchain, listener_key=lkey)
    assert not ok and "is not a member" in why
    assert ochain


def test_a_member_in_touch_with_no_other_member_admits_nobody_by_token(mesh: dict[str, object]) -> None:
    """(tested only through child processes before): a member away during a rotation may hold a
    replaced secret; connected to no other member it cannot know, so it admits no token — a member's chain still
    proves itself."""
    a = crypto.new_key()
    ok, why = _handshake(mesh, crypto.new_key(), token=_token(mesh), in_touch=False)
    assert not ok and "connected to no other member" in why
    assert _handshake(mesh, crypto.new_key(), token=_token(mesh), in_touch=True)[0]
    ca = adm.admit(mesh["key"], mesh["chain"], crypto.node_id(a), NOW)  # type: ignore[arg-type]
    assert _handshake(mesh, a, chain=ca, in_touch=False)[0]


def test_a_members_minted_keys_count_as_that_member() -> None:
    """A member with sybils kept the host's queue full. At a host's door a request counts as the first
    node of its sender's lineage that is neither the founder nor an admin: keys a member mints are that member."""
    founder, m, admin, s1, s2, x = (crypto.new_key() for _ in range(6))
    fid, mid_, aid, s1id, s2id, xid = (crypto.node_id(k) for k in (founder, m, admin, s1, s2, x))
    chain = adm.found(founder, NOW)
    cm = adm.admit(founder, chain, mid_, NOW)
    c1 = adm.admit(m, cm, s1id, NOW)  # minted by m
    c2 = adm.admit(s1, c1, s2id, NOW)  # and by its sybil in turn
    ca = adm.admit(founder, chain, aid, NOW)
    cx = adm.admit(admin, ca, xid, NOW)  # an admin's invitee: itself
    assert adm.accountable(chain) == fid and adm.accountable(cm) == mid_
    assert adm.accountable(c1) == adm.accountable(c2) == mid_
    assert adm.accountable(cx, {aid}) == xid and adm.accountable(ca, {aid}) == aid
    assert adm.accountable(cx) == aid  # an admin no longer: its invitees are its own again


def test_a_token_names_only_members_that_may_admit_its_scope() -> None:
    """A host token named a client-scoped member among its others to dial, and that member refused it."""
    from meshllm.proto.meshcore import token_alternates
    from meshllm.proto.record import PeerRecord, Role

    founder = crypto.new_key()
    chain = adm.found(founder, NOW)

    def rec(scope: tok.Scope, cap: int, role: Role = Role.WORKER) -> PeerRecord:
        k = crypto.new_key()
        c = tuple(adm.admit(founder, chain, crypto.node_id(k), NOW, scope))
        return PeerRecord(crypto.node_id(k), 1, 1, role=role, capacity=cap, addrs=("10.0.0.1:1",), chain=c)

    host, worker, client = rec(tok.Scope.HOST, 5), rec(tok.Scope.WORKER, 9), rec(tok.Scope.CLIENT, 99)
    lite = rec(tok.Scope.HOST, 0, Role.CLIENT)
    recs = [client, worker, host, lite]
    assert [n for n, _ in token_alternates(recs, b"", tok.Scope.HOST)] == [host.node]
    assert [n for n, _ in token_alternates(recs, b"", tok.Scope.WORKER)] == [worker.node, host.node]
    assert [n for n, _ in token_alternates(recs, b"", tok.Scope.CLIENT)] == [client.node, worker.node, host.node]
    assert token_alternates(recs, host.node, tok.Scope.HOST) == []  # never the issuer itself
