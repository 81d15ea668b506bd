"""One vocabulary for where a node stands, computed in one pure place from the records every node holds
(so the host, a worker and a lite client say the same), and mesh-wide figures that keep their history."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshllm.llama.supervisor import running_tokens
from meshllm.proto import crypto
from meshllm.proto import standing as s
from meshllm.proto.record import ModelFacts, NodeState, PeerRecord, Role

HOST, W1, W2, LITE = (bytes([i]) * 32 for i in (9, 1, 2, 7))
FACTS = ModelFacts("tiny", "f" * 16, 18, 1000)


def rec(node: bytes, role: Role = Role.WORKER, **kw: object) -> PeerRecord:
    model = None if role == Role.CLIENT else FACTS
    return PeerRecord(node=node, incarnation=1, seq=1, role=role, model=model, **kw)  # type: ignore[arg-type]


SERVING = rec(HOST, Role.HOST, state=NodeState.SERVING, planned=(W1, HOST), layers=((0, 9), (9, 9)))


def test_the_host_serves_loads_waits_fails_or_is_unreachable() -> None:
    assert s.of_host(SERVING, 0) == s.Standing(s.State.SERVING)
    loading = rec(HOST, Role.HOST, state=NodeState.LOADING, progress=43)
    assert s.of_host(loading, 1).text() == "loading the model: 43%"
    # a crash loop: its reason, not the last run's "100%" (the console said "loading the model: 100%" meanwhile)
    crashed = rec(HOST, Role.HOST, state=NodeState.LOADING, progress=100, why="llama-server exited (SIGABRT)")
    assert s.of_host(crashed, 1) == s.Standing(s.State.LOADING, "llama-server exited (SIGABRT)")
    failed = rec(HOST, Role.HOST, state=NodeState.LOADING, why=s.FAILED_PREFIX + "gave up")
    assert s.of_host(failed, 0) == s.Standing(s.State.FAILED, "gave up")
    waiting = rec(HOST, Role.HOST, state=NodeState.READY, why="waiting for more peers — need 0.6 GB, have 0.3 GB")
    assert s.of_host(waiting, 0).state == s.State.WAITING
    assert s.of_host(waiting, 0).text() == "waiting for more peers — need 0.6 GB, have 0.3 GB"  # said once
    assert s.of_host(SERVING, 5).state == s.State.UNREACHABLE and "5 s" in s.of_host(SERVING, 5).why
    assert s.of_host(SERVING, 3.9).state == s.State.SERVING
    assert s.of_host(rec(HOST), 0).state == s.State.LOADING  # elected, its record not a host's yet


def test_every_node_is_judged_by_its_hosts_record() -> None:
    """A lite client called a serving worker "standby" (it has no plan of its own): now the host's record says who
    is in the plan it runs, and every node judges by that record."""
    assert s.of_node(rec(W1), 0, SERVING, 0) == s.Standing(s.State.SERVING)
    assert s.of_node(rec(W2), 0, SERVING, 0).state == s.State.STANDBY
    assert s.of_node(SERVING, 0, SERVING, 0).state == s.State.SERVING
    assert s.of_node(rec(LITE, Role.CLIENT), 0, SERVING, 0).state == s.State.SERVING  # it answers as the mesh does
    assert s.of_node(rec(W1), 6, SERVING, 0).state == s.State.UNREACHABLE
    assert s.of_node(rec(W1), 0, None, 0) == s.NO_HOST
    loading = rec(HOST, Role.HOST, state=NodeState.LOADING, planned=(W1, HOST), progress=10)
    assert s.of_node(rec(W1), 0, loading, 0) == s.Standing(s.State.LOADING, "loading the model: 10%")
    assert s.of_node(rec(W2), 0, loading, 0).state == s.State.STANDBY
    # the host killed -9: a worker said it "is loading the model", a lite client "no host elected yet"; both now
    # judge the same silent record
    gone = s.of_node(rec(W1), 0, SERVING, 7)
    assert gone == s.Standing(s.State.WAITING, f"its host {crypto.short(HOST)} is unreachable")
    assert s.of_node(rec(LITE, Role.CLIENT), 0, SERVING, 7).state == s.State.UNREACHABLE
    assert s.host_says(SERVING, 7) == f"the host {crypto.short(HOST)} is unreachable: not heard from for 7 s"
    assert s.host_says(SERVING, 0) == "" and s.host_says(None, 0) == ""
    assert s.of_mesh(None, 0) == s.NO_HOST and s.of_mesh(SERVING, 0).state == s.State.SERVING


def test_a_tally_keeps_what_a_dead_source_counted_and_adds_a_restart_on_top() -> None:
    t = s.Tally(2)
    t.see(HOST, (100, 40))
    t.see(W1, (5, 1))
    assert t.total() == (105, 41)
    t.see(HOST, (150, 50))
    assert t.total() == (155, 51)
    # HOST died: W1 hosts now from zero; HOST's last count stays in the sum (it lost its history before)
    t.see(W1, (30, 9))
    assert t.total() == (180, 59)
    t.see(HOST, (7, 2))  # HOST back, counting from zero: on top of what it had
    assert t.total() == (187, 61)


@given(st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_a_tally_never_goes_down_and_stays_bounded(seen: list[tuple[int, int, int]]) -> None:
    t = s.Tally(2)
    before = (0, 0)
    for source, a, b in seen:
        t.see(source, (a, b))
        now = t.total()
        assert now[0] >= before[0] and now[1] >= before[1]
        before = now
        assert len(t._last) <= s.MAX_SOURCES


def test_the_rate_is_over_the_last_seconds_not_per_finished_request() -> None:
    """ "39.9 tok/s now" for a 4.8 tok/s reply: counted when a request ended; now the running tokens count too, and
    the rate is the counter's slope over the last 5 s."""
    m = s.RateMeter(5.0)
    assert m.add(0.0, 0) == 0.0
    assert m.add(0.5, 2) == 0.0  # under a second: no rate yet
    for i in range(1, 20):
        r = m.add(float(i), int(4.8 * i))
    assert 4.0 <= r <= 5.2
    assert m.add(30.0, int(4.8 * 19)) == 0.0 or m.add(31.0, int(4.8 * 19)) == 0.0  # idle: back to 0


def test_running_tokens_from_llama_servers_slots() -> None:
    slots = [{"id": 0, "is_processing": False, "next_token": [{"n_decoded": 99}]},
             {"id": 1, "is_processing": True, "next_token": [{"n_decoded": 231, "n_remain": 69}]},
             {"id": 2, "is_processing": True, "next_token": [{"n_decoded": 4}]}]  # fmt: skip
    assert running_tokens(slots) == 235
    for junk in (None, {}, [1], [{"is_processing": True, "next_token": [{"n_decoded": "x"}]}], [{"next_token": 5}]):
        assert running_tokens(junk) == 0


def test_a_tally_forgets_sources_one_by_one_beyond_its_bound_but_not_their_counts() -> None:
    t = s.Tally(1)
    for i in range(s.MAX_SOURCES + 500):
        t.see(i, (2,))
    assert len(t._last) == s.MAX_SOURCES and t.total() == (2 * (s.MAX_SOURCES + 500),)


def test_a_node_goes_by_one_word_the_elected_one_host_before_its_record_says_so() -> None:
    """The label the console and `mesh-llm status` show comes from the election like the state line: an
    elected node still recording itself a worker reads "host" (beside "elected: taking over as the host")."""
    assert s.label(Role.WORKER, False, True, s.State.LOADING) == "host"
    assert s.label(Role.HOST, False, True, s.State.SERVING) == "host"
    assert s.label(Role.HOST, True, False, s.State.SERVING) == "replica"
    assert s.label(Role.WORKER, False, False, s.State.STANDBY) == "standby"
    assert s.label(Role.WORKER, False, False, s.State.SERVING) == "worker"
    assert s.label(Role.CLIENT, False, False, s.State.SERVING) == "client"
