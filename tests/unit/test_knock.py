"""The doorbell: a knock is listed until approved, then answered with the token made for that node only."""

from __future__ import annotations

from dataclasses import replace

from meshllm.proto import admission as adm
from meshllm.proto import crypto, knock
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.knock import (
    APPROVED,
    KNOCK_SKEW_S,
    MAX_WAITING,
    REFUSED,
    WAIT_KEEP_S,
    WAITING,
    Doorbell,
    KnockAnswer,
    KnockAsk,
)  # fmt: skip
from meshllm.proto.wire import FrameDecoder, encode

FOUNDER = crypto.new_key()
ME = crypto.node_id(FOUNDER)
MESH = crypto.mesh_id_for(ME)
NOW = 1_800_000_000.0


def make_knock(key: crypto.Ed25519PrivateKey, mesh: bytes, name: str, now: float, to: bytes = ME) -> KnockAsk:
    return knock.make_knock(key, mesh, name, now, to)


def test_a_knock_waits_until_approved_and_only_its_node_gets_the_token() -> None:
    bell = Doorbell(MESH, ME, {})
    k, other = crypto.new_key(), crypto.new_key()
    ask = make_knock(k, MESH, "laptop", NOW)
    assert bell.ring(ask, "192.168.1.3:5000", NOW, {}, set()).state == WAITING
    assert list(bell.waiting) == [crypto.node_id(k)] and bell.waiting[crypto.node_id(k)].name == "laptop"
    approved = {crypto.node_id(other): "TOKEN-FOR-OTHER"}
    assert bell.ring(ask, "192.168.1.3:5000", NOW + 2, approved, set()).state == WAITING  # another's approval
    approved[crypto.node_id(k)] = "TOKEN"
    ans = bell.ring(ask, "192.168.1.3:5000", NOW + 4, approved, set())
    assert (ans.state, ans.token) == (APPROVED, "TOKEN") and not bell.waiting
    # the answer survives the wire
    got = FrameDecoder(4096).feed(encode(ans))
    assert got == [ans]


def test_a_knock_that_is_not_a_valid_one_for_this_mesh_is_refused() -> None:
    bell = Doorbell(MESH, ME, {})
    k = crypto.new_key()
    ask = make_knock(k, MESH, "laptop", NOW)
    tok = {crypto.node_id(k): "TOKEN"}  # even approved: a refused knock never gets it

    def refused(a: object, now: float = NOW, members: set[bytes] | None = None) -> str:
        ans = bell.ring(a, "10.0.0.9:1", now, tok, members or set())  # type: ignore[arg-type]
        assert ans.state == REFUSED and not ans.token, ans
        return ans.reason

    assert refused(make_knock(k, b"x" * 16, "laptop", NOW)) == "not this mesh"
    assert refused(replace(ask, name="desk")) == "bad signature"  # the name changed after signing
    assert refused(replace(ask, node=crypto.node_id(crypto.new_key()))) == "bad signature"  # another node's id
    assert "clock" in refused(ask, NOW + KNOCK_SKEW_S + 1)  # a replay, later
    assert refused(make_knock(k, MESH, "a\nb", NOW)) == "malformed knock"
    assert "already a member" in refused(ask, members={crypto.node_id(k)})  # or revoked: it has its admission
    assert not bell.waiting


def test_the_list_of_knocks_is_bounded_and_forgets_the_silent() -> None:
    bell = Doorbell(MESH, ME, {})
    keys = [crypto.new_key() for _ in range(MAX_WAITING + 1)]
    for i, k in enumerate(keys):
        bell.ring(make_knock(k, MESH, f"n{i}", NOW + i), f"10.0.{i}.9:1", NOW + i, {}, set())
    assert len(bell.waiting) == MAX_WAITING and crypto.node_id(keys[0]) not in bell.waiting  # the oldest went
    late = NOW + MAX_WAITING + WAIT_KEEP_S + 1
    fresh = crypto.new_key()
    bell.ring(make_knock(fresh, MESH, "new", late), "10.0.0.9:1", late, {}, set())
    assert list(bell.waiting) == [crypto.node_id(fresh)]  # the others fell silent long ago


def test_a_refused_node_is_told_so_and_forgotten_even_if_approved() -> None:
    bell = Doorbell(MESH, ME, {})
    k = crypto.new_key()
    ask = make_knock(k, MESH, "laptop", NOW)
    assert bell.ring(ask, "10.0.0.9:1", NOW, {}, set()).state == WAITING
    ans = bell.ring(ask, "10.0.0.9:1", NOW + 2, {crypto.node_id(k): "TOKEN"}, set(), {crypto.node_id(k)})
    assert ans.state == REFUSED and not ans.token and "refused" in ans.reason and not bell.waiting


def test_a_knock_relayed_by_a_node_that_announced_the_mesh_as_its_own_is_refused() -> None:
    """A neighbour announced the mesh with its own key, answered a real node's knocks "waiting" and relayed
    them to the founder; after `approve` it replayed one and took the token. A knock names the node it was sent to
    (the key its connection pinned): the founder refuses one addressed to anyone else, whatever it relays."""
    bell = Doorbell(MESH, ME, {})
    real, neighbour = crypto.new_key(), crypto.node_id(crypto.new_key())
    relayed = make_knock(real, MESH, "laptop", NOW, to=neighbour)  # the real node knocked at the neighbour
    ans = bell.ring(relayed, "192.168.1.66:5000", NOW, {crypto.node_id(real): "TOKEN"}, set())
    assert ans.state == REFUSED and not ans.token and "addressed to another node" in ans.reason
    assert not bell.waiting  # nothing listed: `approve` cannot be tricked into approving what the neighbour relays
    assert bell.ring(replace(relayed, to=ME), "192.168.1.66:5000", NOW, {}, set()).reason == "bad signature"
    direct = make_knock(real, MESH, "laptop", NOW)  # the same node knocking at the founder itself: listed
    assert bell.ring(direct, "192.168.1.3:5000", NOW, {}, set()).state == WAITING


def test_an_approval_token_admits_only_the_node_that_knocked() -> None:
    """The approval was an ordinary token that named no node; now it names the knocking key."""
    from meshllm.proto.auth import AuthChallenge, AuthHello, check_proof, make_proof

    chain = adm.found(FOUNDER, NOW)
    secret = b"s" * tok.SECRET_LEN
    knocker, thief = crypto.new_key(), crypto.new_key()
    t = tok.mint(FOUNDER, MESH, secret, ["10.0.0.1:1"], NOW, 600, tok.Scope.HOST, node=crypto.node_id(knocker))
    assert tok.parse(t.encode()) == t and t.node == crypto.node_id(knocker)
    assert "only" in t.redacted()
    plain = tok.mint(FOUNDER, MESH, secret, ["10.0.0.1:1"], NOW, 600)
    assert tok.parse(plain.encode()).node is None and len(plain.encode()) < len(t.encode())
    forged = replace(t, node=crypto.node_id(thief))  # re-aimed after signing
    assert not tok.parse(forged.encode()).signature_ok()

    def verdict(key: crypto.Ed25519PrivateKey) -> tuple[bool, str]:
        nonce, who = b"n" * 32, crypto.node_id(key)
        hello = AuthHello(dialler=who, listener=ME, mesh_id=MESH)
        proof = make_proof(key, secret, AuthChallenge(nonce), ME, token=t)
        v = check_proof(key=FOUNDER, my_chain=chain, mesh_id=MESH, secret=secret, hello=hello, nonce=nonce,
                        proof=proof, scope_of=lambda n: None, now=NOW + 1)  # fmt: skip
        return v.ok, v.reason

    assert verdict(knocker)[0]
    ok, why = verdict(thief)
    assert not ok and "admits" in why and crypto.short(crypto.node_id(knocker)) in why


def test_a_refusal_ends_the_knocking_only_from_the_founder_or_an_admin() -> None:
    """A fake announcement answering "refused" ended anyone's --join-lan."""
    no = KnockAnswer(REFUSED, reason="go away")
    stranger, admin = crypto.node_id(crypto.new_key()), crypto.node_id(crypto.new_key())
    assert knock.refusal_is_final(no, MESH, ME)  # the founder: its key is the mesh's id
    assert not knock.refusal_is_final(no, MESH, stranger)
    grant = sgn.grant_admin(FOUNDER, MESH, admin, NOW)
    assert knock.refusal_is_final(replace(no, grant=grant.to_wire()), MESH, admin)
    assert not knock.refusal_is_final(replace(no, grant=grant.to_wire()), MESH, stranger)  # another's grant
    own = sgn.grant_admin(FOUNDER, MESH, stranger, NOW).to_wire()
    own[-1] = bytes(64)  # a grant it forged
    assert not knock.refusal_is_final(replace(no, grant=own), MESH, stranger)
    assert not knock.refusal_is_final(KnockAnswer(WAITING), MESH, ME)


def test_a_flood_from_one_address_never_evicts_another_machines_knock_and_approve_finds_the_evicted() -> None:
    """128 knocks a second of fresh keys kept a real knock listed 11.7 % of the time. A source holds at
    most PER_SOURCE places; what was evicted anyway (MAX_WAITING sources) is remembered for `approve`."""
    bell = Doorbell(MESH, ME, {})
    real = crypto.new_key()
    bell.ring(make_knock(real, MESH, "laptop", NOW), "192.168.1.3:5000", NOW, {}, set())
    for i in range(1000):
        t = NOW + 0.1 + i / 128
        bell.ring(make_knock(crypto.new_key(), MESH, f"f{i}", t), "192.168.1.66:6000", t, {}, set())
    assert crypto.node_id(real) in bell.waiting and len(bell.waiting) == 1 + knock.PER_SOURCE
    # many sources: the oldest goes, and is remembered (its next knock finds its first-heard time again)
    for i in range(MAX_WAITING):
        t = NOW + 10 + i
        bell.ring(make_knock(crypto.new_key(), MESH, f"s{i}", t), f"10.0.{i}.1:1", t, {}, set())
    assert crypto.node_id(real) not in bell.waiting and crypto.node_id(real) in bell.gone
    assert len(bell.gone) <= knock.MAX_GONE
    t = NOW + 50
    bell.ring(make_knock(real, MESH, "laptop", t), "192.168.1.3:5000", t, {}, set())
    assert bell.waiting[crypto.node_id(real)].first == NOW and crypto.node_id(real) not in bell.gone
