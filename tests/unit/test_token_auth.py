"""Invite tokens, admission chains and the auth handshake (virtual time)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.auth import AuthChallenge, AuthHello, check_proof, make_proof

NOW = 1_800_000_000.0


@pytest.fixture
def mesh() -> dict[str, object]:
    founder = crypto.new_key()
    chain = tok.found(founder, NOW)
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
    assert tok.verify_chain(chain, founder, mid) is None  # type: ignore[arg-type]
    a = crypto.new_key()
    ca = tok.admit(key, chain, crypto.node_id(a), NOW)  # type: ignore[arg-type]
    b = crypto.new_key()
    cb = tok.admit(a, ca, crypto.node_id(b), NOW)
    assert tok.verify_chain(cb, crypto.node_id(b), mid) is None  # type: ignore[arg-type]
    assert tok.verify_chain(cb, crypto.node_id(a), mid) == "chain admits another node"  # type: ignore[arg-type]
    assert "another mesh" in (tok.verify_chain(cb, crypto.node_id(b), b"y" * 16) or "")
    # an outsider cannot start its own chain in this mesh, nor sign a link it was not given
    outsider = crypto.new_key()
    fake = tok.admit(outsider, tok.found(outsider, NOW), crypto.node_id(b), NOW)
    assert tok.verify_chain(fake, crypto.node_id(b), mid) is not None  # type: ignore[arg-type]
    forged = [*chain, (mid, crypto.node_id(b), founder, int(NOW), b"\0" * 64)]  # type: ignore[misc]
    assert "bad signature" in (tok.verify_chain(forged, crypto.node_id(b), mid) or "")  # type: ignore[arg-type]
    assert tok.verify_chain(tok.chain_from_wire(tok.chain_to_wire(cb)), crypto.node_id(b), mid) is None  # type: ignore[arg-type]


def _handshake(
    mesh: dict[str, object],
    dialler: crypto.Ed25519PrivateKey,
    *,
    secret: bytes | None = None,
    token: tok.Token | None = None,
    chain: list[tok.Link] | None = None,
    now: float = NOW,
    nonce: bytes | None = None,
    proof_nonce: bytes | None = None,
    members: frozenset[bytes] = frozenset(),
) -> tuple[bool, str]:
    listener = crypto.node_id(mesh["key"])  # type: ignore[arg-type]
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
        key=mesh["key"], my_chain=mesh["chain"], mesh_id=mesh["mesh_id"], secret=mesh["secret"],  # type: ignore[arg-type]
        hello=hello, nonce=nonce, proof=proof, is_member=lambda n: n in members, now=now,
    )  # fmt: skip
    if v.ok:
        assert v.chain is not None
        assert tok.verify_chain(v.chain, crypto.node_id(dialler), mesh["mesh_id"]) is None  # type: ignore[arg-type]
    return v.ok, v.reason


def test_joiner_with_a_valid_token_is_admitted(mesh: dict[str, object]) -> None:
    ok, why = _handshake(mesh, crypto.new_key(), token=_token(mesh))
    assert ok, why


def test_member_with_its_chain_is_accepted(mesh: dict[str, object]) -> None:
    a = crypto.new_key()
    ca = tok.admit(mesh["key"], mesh["chain"], crypto.node_id(a), NOW)  # type: ignore[arg-type]
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
    assert _handshake(mesh, joiner, token=alien, members=frozenset({crypto.node_id(outsider)}))[0]
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
