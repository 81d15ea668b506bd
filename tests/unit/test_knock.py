"""[lan] The doorbell: a knock is listed until approved, then answered with the token made for that node only."""

from __future__ import annotations

from dataclasses import replace

from meshllm.proto import crypto
from meshllm.proto.knock import (
    APPROVED,
    KNOCK_SKEW_S,
    MAX_WAITING,
    REFUSED,
    WAIT_KEEP_S,
    WAITING,
    Doorbell,
    make_knock,
)  # fmt: skip
from meshllm.proto.wire import FrameDecoder, encode

MESH = b"m" * 16
NOW = 1_800_000_000.0


def test_a_knock_waits_until_approved_and_only_its_node_gets_the_token() -> None:
    bell = Doorbell(MESH, {})
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
    bell = Doorbell(MESH, {})
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
    bell = Doorbell(MESH, {})
    keys = [crypto.new_key() for _ in range(MAX_WAITING + 1)]
    for i, k in enumerate(keys):
        bell.ring(make_knock(k, MESH, f"n{i}", NOW + i), "10.0.0.9:1", NOW + i, {}, set())
    assert len(bell.waiting) == MAX_WAITING and crypto.node_id(keys[0]) not in bell.waiting  # the oldest went
    late = NOW + MAX_WAITING + WAIT_KEEP_S + 1
    fresh = crypto.new_key()
    bell.ring(make_knock(fresh, MESH, "new", late), "10.0.0.9:1", late, {}, set())
    assert list(bell.waiting) == [crypto.node_id(fresh)]  # the others fell silent long ago


def test_a_refused_node_is_told_so_and_forgotten_even_if_approved() -> None:
    bell = Doorbell(MESH, {})
    k = crypto.new_key()
    ask = make_knock(k, MESH, "laptop", NOW)
    assert bell.ring(ask, "10.0.0.9:1", NOW, {}, set()).state == WAITING
    ans = bell.ring(ask, "10.0.0.9:1", NOW + 2, {crypto.node_id(k): "TOKEN"}, set(), {crypto.node_id(k)})
    assert ans.state == REFUSED and not ans.token and "refused" in ans.reason and not bell.waiting
