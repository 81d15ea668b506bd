"""The reach core: control-packet layouts, the relay rule (never an open reflector) and the punch schedule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshllm.proto import crypto, reach
from meshllm.proto.reach import LOW_TTL, LOW_TTL_S, PROBE, PROBE_ACK, PUNCH_S, RELAY, RELAYED, Puncher

KA, KB, KC = crypto.new_key(), crypto.new_key(), crypto.new_key()
A, B, C = (crypto.node_id(k) for k in (KA, KB, KC))
X = bytes([9]) * 32
QUIC = b"\xc0" + b"q" * 100  # any datagram whose first byte has bit 0x40 set
AT_A, AT_B, AT_X = ("198.51.100.2", 4000), ("203.0.113.2", 5000), ("192.0.2.66", 6666)
TA, TB = b"tokenAAA", b"tokenBBB"  # the pair tokens of the relay's connections to A and to B
MEMBERS = {AT_A: (A, TA), AT_B: (B, TB)}
ADDR_OF = {A: (AT_A, TA), B: (AT_B, TB)}


def test_relay_forwards_between_members_and_names_the_sender_itself() -> None:
    out = reach.relay_forward(reach.relay_packet(RELAY, B, TA, QUIC), AT_A, MEMBERS, ADDR_OF)
    assert out == (reach.relay_packet(RELAYED, A, TB, QUIC), AT_B)


def test_relay_is_never_an_open_reflector() -> None:
    pkt = reach.relay_packet(RELAY, B, TA, QUIC)
    assert reach.relay_forward(pkt, AT_X, MEMBERS, ADDR_OF) is None  # sender is no member we are connected to
    assert reach.relay_forward(reach.relay_packet(RELAY, C, TA, QUIC), AT_A, MEMBERS, ADDR_OF) is None  # unknown dst
    assert reach.relay_forward(reach.relay_packet(RELAY, A, TA, QUIC), AT_A, MEMBERS, ADDR_OF) is None  # to itself
    assert reach.relay_forward(reach.relay_packet(RELAYED, B, TA, QUIC), AT_A, MEMBERS, ADDR_OF) is None  # wrong kind
    assert reach.relay_forward(bytes([RELAY]) + B + TA + b"\x01probe", AT_A, MEMBERS, ADDR_OF) is None  # not QUIC


def test_a_spoofed_members_source_without_its_token_is_dropped() -> None:
    """A third party that sends from a member's address (a spoofed UDP source) does not know the
    token of the member's connection to the relay: nothing is forwarded."""
    for token in (TB, b"\0" * 8, b"tokenAAB"):
        assert reach.relay_forward(reach.relay_packet(RELAY, B, token, QUIC), AT_A, MEMBERS, ADDR_OF) is None


@given(st.binary(max_size=200), st.sampled_from([AT_A, AT_B, AT_X]))
def test_relay_rule_on_any_bytes_forwards_only_member_to_member_without_growth(
    data: bytes, src: tuple[str, int]
) -> None:
    out = reach.relay_forward(data, src, MEMBERS, ADDR_OF)
    if out is not None:
        pkt, dst = out
        assert src in MEMBERS and dst in MEMBERS and dst != src
        assert len(pkt) == len(data)  # no amplification
        assert pkt[1:33] == MEMBERS[src][0]


def test_virtual_address_round_trip() -> None:
    v = reach.relayed_addr(C, B)
    assert reach.parse_relayed_addr(v) == (C, B)
    assert reach.parse_relayed_addr(("127.0.0.1", 4)) is None
    assert reach.parse_relayed_addr(("relay:zz:00", 0)) is None


def test_punch_schedule_low_ttl_first_then_full_then_gives_up() -> None:
    p = Puncher(KA)
    p.start(B, [AT_B], now=0.0, dialler=True)
    first = p.tick(0.0)
    assert [s.ttl for s in first] == [LOW_TTL] and first[0].addr == AT_B
    assert p.tick(0.05) == []  # not before the next probe is due
    later = p.tick(LOW_TTL_S + 0.01)
    assert [s.ttl for s in later] == [None]
    assert reach.parse_probe(later[0].data) == (PROBE, A, p.attempts[B].nonce)
    assert reach.probe_is_from(later[0].data, B) and not reach.probe_is_from(later[0].data, C)
    assert p.tick(PUNCH_S + 0.01) == [] and B not in p.attempts


def test_probe_answered_and_dialler_told_where_to_dial() -> None:
    a, b = Puncher(KA), Puncher(KB)
    att = a.start(B, [AT_B], now=0.0, dialler=True)
    b.start(A, [AT_A], now=0.1, dialler=False, nonce=att.nonce)
    # B's probe reaches A from B's (possibly remapped) public address: A answers there and may dial it
    h = a.on_probe(b.tick(0.1)[0].data, ("203.0.113.2", 5999), 0.2)
    assert h.peer == B and h.dial == ("203.0.113.2", 5999) and h.confirmed is None
    assert [(reach.parse_probe(s.data), s.addr) for s in h.sends] == [
        ((PROBE_ACK, A, att.nonce), ("203.0.113.2", 5999))
    ]
    # B answers A's probe but never dials; A's ack proves the path both ways to B
    h = b.on_probe(a.tick(0.2)[0].data, AT_A, 0.3)
    assert h.dial is None and len(h.sends) == 1 and h.confirmed is None
    ack = a.on_probe(reach.probe(PROBE, KB, A, att.nonce), AT_B, 0.3).sends[0]
    h = b.on_probe(ack.data, AT_A, 0.4)
    assert h.sends == [] and h.dial is None and h.confirmed == AT_A


def test_probes_with_a_wrong_nonce_or_from_strangers_are_ignored() -> None:
    a = Puncher(KA)
    a.start(B, [AT_B], now=0.0, dialler=True)
    nothing = reach.Heard()
    nonce = a.attempts[B].nonce
    assert a.on_probe(reach.probe(PROBE, KB, A, b"\x00" * 8), AT_B, 0.1) == nothing
    assert a.on_probe(reach.probe(PROBE, KC, A, nonce), AT_B, 0.1) == nothing
    assert a.on_probe(b"\x01short", AT_B, 0.1) == nothing


def test_a_forged_ack_cannot_move_a_path() -> None:
    """The rendezvous knows the nonce: unsigned, it could forge B's ack from an address of its own."""
    a = Puncher(KA)
    nonce = a.start(B, [AT_B], now=0.0, dialler=True).nonce
    nothing = reach.Heard()
    genuine = reach.probe(PROBE_ACK, KB, A, nonce)
    forged = genuine[:41] + reach.probe(PROBE_ACK, KC, A, nonce)[41:]  # B's name and nonce, C's signature
    assert a.on_probe(forged, AT_X, 0.1) == nothing
    assert a.on_probe(reach.probe(PROBE_ACK, KB, C, nonce), AT_X, 0.1) == nothing  # B's, but signed for C
    assert a.on_probe(genuine[:-1] + bytes([genuine[-1] ^ 1]), AT_X, 0.1) == nothing
    assert a.on_probe(genuine, AT_B, 0.1).confirmed == AT_B


def test_a_quiet_attempt_stops_probing_but_still_answers() -> None:
    a = Puncher(KA)
    att = a.start(B, [AT_B], now=0.0, dialler=True)
    a.quiet(B)
    assert a.tick(2.0) == []
    assert len(a.on_probe(reach.probe(PROBE, KB, A, att.nonce), AT_B, 2.0).sends) == 1


def test_relay_order_named_first_then_connected_to_the_target_then_rtt() -> None:
    def c(node: bytes, relays: bool, reaches: bool, rtt: float | None, addr: str = "1.2.3.4:5") -> reach.RelayCandidate:
        return reach.RelayCandidate(node, relays, (addr,), reaches, rtt)

    cands = [c(A, True, False, 1.0), c(B, True, True, 50.0), c(C, True, True, 5.0), c(X, False, True, 1.0)]
    assert reach.order_relays(cands, None) == [C, B, A]  # X does not relay
    named = [*cands, c(bytes(32), False, False, None, "9.9.9.9:7000")]
    assert reach.order_relays(named, "9.9.9.9:7000")[0] == bytes(32)


def test_observe_keeps_the_two_newest_reflexive_addresses_and_spots_no_nat() -> None:
    own = ["192.168.1.2:4000", "127.0.0.1:4000"]
    local = {"192.168.1.2", "127.0.0.1"}
    r, public = reach.observe([], own, "198.51.100.2:4000", local, 4000)
    assert r == ["198.51.100.2:4000"] and not public
    assert reach.observe(r, own, "198.51.100.2:4000", local, 4000) == (r, False)  # seen again: nothing new
    r2, _ = reach.observe(r, own, "198.51.100.2:5111", local, 4000)
    r3, _ = reach.observe(r2, own, "198.51.100.2:6222", local, 4000)
    assert r3 == ["198.51.100.2:5111", "198.51.100.2:6222"]
    assert reach.observe(r, own, "192.168.1.2:4000", local, 4000) == (r, True)  # a LAN member: no NAT between us
    assert reach.advertised(r3, own, 16) == ["198.51.100.2:6222", "198.51.100.2:5111", *own]
    # IPv6 is not translated, and a home router's firewall may stand in front of our own address: no relay
    v6 = "[2001:db8::2]:4000"
    assert reach.observe(r, [*own, v6], v6, {*local, "2001:db8::2"}, 4000) == (r, False)
    assert reach.observe(r, own, "[2001:db8::99]:4000", local, 4000) == (r, False)  # nor a reflexive address


def test_direct_dial_skips_a_natted_peers_public_address_when_a_punch_is_possible() -> None:
    addrs = ["203.0.113.2:5000", "192.168.1.2:5000"]
    assert reach.direct_targets(addrs, set(), can_punch=True) == addrs  # public (or not known yet)
    assert reach.direct_targets(addrs, {"203.0.113.2:5000"}, can_punch=True) is None  # punch first
    assert reach.direct_targets(addrs, {"203.0.113.2:5000"}, can_punch=False) == addrs  # nobody to coordinate


def test_rendezvous_vouches_for_the_sender_and_tells_it_where_the_target_is() -> None:
    req = reach.PunchRequest(src=C, dst=B, nonce=b"n" * 8, addrs=["192.168.1.2:4000"])  # claims to be C
    fwd, back = reach.rendezvous(A, ["198.51.100.2:4000"], ["203.0.113.2:5000"], req)
    assert (fwd.src, fwd.dst, fwd.addrs) == (A, B, ["198.51.100.2:4000", "192.168.1.2:4000"])
    assert (back.src, back.dst, back.addrs, back.nonce) == (B, A, ["203.0.113.2:5000"], req.nonce)
    assert reach.rendezvous(B, [], [], req) == []  # to itself
    assert reach.rendezvous(A, [], [], reach.PunchRequest(src=A, dst=B, nonce=b"short")) == []


def test_a_punch_request_points_our_probes_at_one_address_of_the_askers_choice_at_most() -> None:
    """A member once made a node send 400 probes to 8 addresses of its choice."""
    record = ("198.51.100.2:4000", "10.0.0.2:4000")
    claimed = ["203.0.113.9:1", "192.0.2.1:2", "10.0.0.2:4000", "192.0.2.3:3", "198.51.100.2:4000"]
    assert reach.punch_targets(claimed, record) == ["203.0.113.9:1", "10.0.0.2:4000", "198.51.100.2:4000"]
    assert reach.punch_targets([], record) == []


def test_a_relay_s_budget_per_pair_refills_at_its_rate() -> None:
    """A token bucket per (sender, destination): a quarter second's worth at once (at least 64 KiB), then
    ``rate`` bytes/s; pairs apart; rate 0: no cap; quiet pairs forgotten."""
    from meshllm.proto.reach import PAIR_IDLE_S, PairBudget

    b = PairBudget(rate=1024 * 1024)  # 1 MiB/s: 256 KiB at once
    ab, ba = (("a", 1), ("b", 2)), (("b", 2), ("a", 1))
    assert sum(b.take(ab, 1024, 0.0) for _ in range(300)) == 256
    assert not b.take(ab, 1024, 0.0) and b.take(ba, 1024, 0.0)  # the other direction is another pair
    assert b.take(ab, 1024, 0.001) and not b.take(ab, 1024, 0.001)  # 1 ms: 1 KiB more
    assert sum(b.take(ab, 1024, 0.1) for _ in range(300)) == 101  # 99 ms more: 101 KiB (1 ms carried over)
    slow, free = PairBudget(rate=100), PairBudget(rate=0)
    assert sum(slow.take(ab, 1024, 0.0) for _ in range(100)) == 64  # the burst is 64 KiB at least
    assert all(free.take(ab, 10**9, 0.0) for _ in range(10))
    assert b.pairs(0.2) == 2 and b.pairs(PAIR_IDLE_S + 1) == 0
