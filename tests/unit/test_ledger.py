"""The members a node remembers across restarts (proto/ledger.py): kept after they leave, bounded, aged, saved and
read back (the first saved form too), and dialled on a schedule that slows for a member that keeps failing."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from meshllm.proto import ledger as L

ME = b"\x00" * 32


def node(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_member_is_kept_after_it_is_gone_and_saved_only_when_something_changed() -> None:
    led = L.Ledger(ME)
    assert led.see(node(1), ["10.0.0.1:4000"], 1000.0)  # new: save
    assert not led.see(node(1), ["10.0.0.1:4000"], 1010.0)  # seen again, same place: no write
    assert led.see(node(1), ["10.0.0.1:4001"], 1020.0)  # moved: save
    assert led.see(node(1), ["10.0.0.1:4001"], 1020.0 + L.RESAVE_S)  # an hour on: "seen" written again
    assert not led.see(ME, ["10.0.0.9:1"], 1000.0) and ME not in led.members  # never ourselves
    assert not led.see(node(2), [], 1000.0) and node(2) not in led.members  # nothing to dial
    assert node(1) in led.members  # nothing but age forgets a member: leaving does not


def test_bounded_to_the_most_recently_seen_and_aged() -> None:
    led = L.Ledger(ME)
    for i in range(L.MAX_MEMBERS + 5):
        led.see(node(i + 1), [f"10.0.0.1:{i + 1}"], 1000.0 + i)
    assert len(led.members) == L.MAX_MEMBERS
    assert node(1) not in led.members and node(L.MAX_MEMBERS + 5) in led.members  # the oldest went first
    led.see(node(999), ["10.0.0.2:1"], 1000.0 + L.MAX_AGE_S + 100)
    assert set(led.members) == {node(999)}  # a month unseen: forgotten
    assert len(L.Ledger(ME).members) == 0
    led.see(node(7), [f"10.0.0.3:{p}" for p in range(20)], 0.0 + L.MAX_AGE_S + 100)
    assert len(led.members[node(7)].addrs) == L.MAX_ADDRS


def test_the_ordered_list_puts_the_most_recently_seen_first() -> None:
    led = L.Ledger(ME)
    led.see(node(1), ["a:1"], 100.0)
    led.see(node(2), ["b:2"], 300.0)
    led.see(node(3), ["c:3"], 200.0)
    assert [n for n, _ in led.ordered()] == [node(2), node(3), node(1)]


def test_dialled_every_redial_then_slower_and_never_while_present() -> None:
    led = L.Ledger(ME)
    led.see(node(1), ["10.0.0.1:1"], 0.0)
    led.see(node(2), ["10.0.0.1:2"], 0.0)
    assert led.to_dial({node(2)}, 0.0) == {node(1): ["10.0.0.1:1"]}  # node 2 is connected (or in gossip)
    assert led.to_dial(set(), 1.0) == {node(2): ["10.0.0.1:2"]}  # node 1 waits its turn
    assert node(1) in led.to_dial(set(), L.REDIAL_S)
    t = L.REDIAL_S
    for _ in range(L.SLOW_AFTER):  # keep failing
        t += L.REDIAL_S
        led.to_dial(set(), t)
    assert node(1) not in led.to_dial(set(), t + L.REDIAL_S)  # slowed down
    assert node(1) in led.to_dial(set(), t + L.SLOW_REDIAL_S)
    led.see(node(1), ["10.0.0.1:1"], 10.0)  # heard of again: back to the quick schedule
    assert node(1) in led.to_dial(set(), t + L.SLOW_REDIAL_S + 0.1)


def test_saved_and_read_back_and_the_first_form_and_damaged_entries() -> None:
    led = L.Ledger(ME)
    led.see(node(1), ["10.0.0.1:1", "[::1]:2"], 5000.0)
    back = L.from_wire(ME, json.loads(json.dumps(L.to_wire(led))), 6000.0)
    assert back.members == led.members
    old = {node(2).hex(): ["10.0.0.2:2"], "zz": ["x:1"], "ab": ["y:1"], node(3).hex(): {"addrs": "no", "seen": 1},
           node(4).hex(): {"addrs": ["10.0.0.4:4"], "seen": True}, ME.hex(): ["10.0.0.9:9"],
           node(5).hex(): {"addrs": ["10.0.0.5:5"], "seen": 9e12}}  # fmt: skip
    back = L.from_wire(ME, old, 6000.0)
    assert set(back.members) == {node(2), node(5)}  # the first form reads as seen now; the damaged ones skipped
    assert back.members[node(2)].seen == 6000.0 and back.members[node(5)].seen == 6000.0  # none seen in the future
    assert L.from_wire(ME, ["not", "a", "dict"], 1.0).members == {}
    stale = {node(6).hex(): {"addrs": ["10.0.0.6:6"], "seen": 0}}
    assert L.from_wire(ME, stale, L.MAX_AGE_S + 1.0).members == {}  # aged out on load


@given(st.lists(st.tuples(st.integers(1, 200), st.integers(0, 10**8)), max_size=300))
def test_never_more_than_the_bound(seen: list[tuple[int, int]]) -> None:
    led = L.Ledger(ME)
    for i, t in seen:
        led.see(node(i), [f"10.0.0.1:{i}"], float(t))
    assert len(led.members) <= L.MAX_MEMBERS
    assert all(isinstance(k.addrs, tuple) and k.addrs for k in led.members.values())
