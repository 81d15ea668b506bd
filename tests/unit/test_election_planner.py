"""Election and split plan: pure functions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.proto.election import MARGIN, Candidate, Debouncer, elect
from meshllm.proto.layout import (
    GB,
    Assignment,
    MiB,
    ModelShape,
    Plan,
    Slot,
    Waiting,
    device_of_unit,
    host_fixed_bytes,
    spread,
)
from meshllm.proto.planner import plan
from meshllm.proto.spill import experts_override

FP = "f" * 64
A, B, C, D = (bytes([i]) * 32 for i in (1, 2, 3, 4))


def test_highest_capacity_wins_ties_to_highest_id() -> None:
    cands = [Candidate(A, 10, FP), Candidate(B, 20, FP), Candidate(C, 20, FP), Candidate(D, 99, FP, role="client")]
    assert elect(cands, FP) == C
    assert elect([Candidate(A, 50, "other"), *cands], FP) == C  # another model's node is no candidate
    assert elect([Candidate(A, 1, "other")], FP) is None


def test_only_a_host_scoped_member_is_elected() -> None:
    """A member claiming any capacity (2**62 took the mesh once) is no candidate without the host scope."""
    from meshllm.proto.token import Scope

    huge = 2**62
    cands = [
        Candidate(A, 10, FP),
        Candidate(B, huge, FP, scope=Scope.WORKER),
        Candidate(C, huge, FP, scope=Scope.CLIENT),
    ]
    assert elect(cands, FP) == A
    assert elect(cands, FP, sitting=B) == A  # nor does it keep a seat it claims
    assert elect(cands[1:], FP) is None


def test_sitting_host_keeps_the_role_unless_clearly_beaten() -> None:
    cands = [Candidate(A, 100, FP), Candidate(B, int(100 * MARGIN), FP)]
    assert elect(cands, FP, sitting=A) == A
    cands[1] = Candidate(B, int(100 * MARGIN) + 1, FP)
    assert elect(cands, FP, sitting=A) == B


def test_debouncer_waits_for_a_stable_answer() -> None:
    d = Debouncer(hold_s=2.0)
    assert d.propose(A, 0.0) is None
    assert d.propose(A, 1.9) is None
    assert d.propose(A, 2.0) == A
    assert d.propose(B, 3.0) == A  # flaps are ignored ...
    assert d.propose(A, 3.5) == A
    assert d.propose(B, 4.0) == A
    assert d.propose(B, 6.0) == B  # ... until the new answer holds


SHAPE = ModelShape(
    n_layer=10, layer_bytes=(100 * MiB,) * 10, embd_bytes=200 * MiB, output_bytes=200 * MiB, other_bytes=MiB,
    kv_bytes_per_token_layer=1024, n_embd=1024, n_vocab=32000,
)  # fmt: skip
CTX = 1024


def _fits(layers: int) -> int:
    """Capacity of a worker that fits exactly ``layers`` layers."""
    return layers * SHAPE.layer_cost(0, CTX) + SHAPE.compute_bytes(CTX, output=False)


def test_a_host_that_holds_everything_runs_alone() -> None:
    p = plan(SHAPE, Slot(A, 10 * GB), [Slot(B, 10 * GB)], CTX)
    assert isinstance(p, Plan)
    assert [a.node for a in p.assignments] == [A] and p.assignments[0].count == 10 and p.standby == (B,)


def test_workers_take_the_first_layers_the_host_the_last_and_the_output() -> None:
    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    p = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(3), rtt_ms=5), Slot(C, _fits(8), rtt_ms=1)], CTX)
    assert isinstance(p, Plan)
    # C holds more: it is used first and covers everything the host cannot; B stands by
    assert [(a.node, a.first, a.count) for a in p.assignments] == [(C, 0, 6), (A, 6, 4)]
    assert p.standby == (B,) and p.tensor_split == (6, 5)  # the host's entry counts the output layer
    assert all(a.bytes <= s for a, s in zip(p.assignments, [_fits(8), host_cap], strict=True))


def test_far_nodes_only_when_near_ones_do_not_suffice() -> None:
    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    p = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(6), rtt_ms=200), Slot(C, _fits(6), rtt_ms=10)], CTX)
    assert isinstance(p, Plan) and [a.node for a in p.assignments] == [C, A]
    p = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(6), rtt_ms=200), Slot(C, _fits(3), rtt_ms=10)], CTX)
    assert isinstance(p, Plan) and [(a.node, a.count) for a in p.assignments] == [(C, 3), (B, 3), (A, 4)]


def test_a_node_serving_a_replica_is_taken_only_after_the_idle_ones() -> None:
    """A host that lost its worker takes a standby node before one that serves a replica of the model
    (taking that ends the replica and every answer it streams); when the idle ones do not suffice, it takes it."""
    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    others = [Slot(B, _fits(8)), Slot(C, _fits(6))]
    p = plan(SHAPE, Slot(A, host_cap), others, CTX, busy={B})
    assert isinstance(p, Plan) and [a.node for a in p.assignments] == [C, A] and p.standby == (B,)
    p = plan(SHAPE, Slot(A, host_cap), others, CTX)  # without: the larger one
    assert isinstance(p, Plan) and [a.node for a in p.assignments] == [B, A]
    p = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(8)), Slot(C, _fits(3))], CTX, busy={B})
    assert isinstance(p, Plan) and [(a.node, a.count) for a in p.assignments] == [(C, 3), (B, 3), (A, 4)]
    kept = plan(SHAPE, Slot(A, host_cap), others, CTX, prefer={B}, busy={B})  # a node of the plan stays in it
    assert isinstance(kept, Plan) and [a.node for a in kept.assignments] == [B, A]


def test_not_enough_memory_says_how_much() -> None:
    w = plan(SHAPE, Slot(A, GB // 2), [Slot(B, _fits(2))], CTX)
    assert isinstance(w, Waiting) and w.need > w.have
    assert w.message().startswith("waiting for more peers — need ")


def Trusted(node: bytes, capacity: int, rtt_ms: float = 0.0) -> Slot:  # a Slot trusted with prompts
    return Slot(node, capacity, rtt_ms, prompts=True)


def test_the_token_embedding_goes_to_the_first_worker_where_it_has_room() -> None:
    """Patch 0013: the first worker takes the embedding when it has room for it beside its layers; the layout is the
    same either way, and the host, which keeps room for it, no longer counts it."""
    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    tight = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(6), rtt_ms=1, prompts=True)], CTX)
    roomy = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(6) + SHAPE.embd_bytes, rtt_ms=1, prompts=True)], CTX)
    assert isinstance(tight, Plan) and isinstance(roomy, Plan)
    assert not tight.embd_first and roomy.embd_first
    assert [(a.node, a.first, a.count) for a in tight.assignments] == [(a.node, a.first, a.count)
                                                                       for a in roomy.assignments]  # fmt: skip
    assert roomy.assignments[0].bytes == tight.assignments[0].bytes + SHAPE.embd_bytes
    assert roomy.assignments[1].bytes == tight.assignments[1].bytes - SHAPE.embd_bytes
    short = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(6) + SHAPE.embd_bytes - 1, rtt_ms=1, prompts=True)], CTX)
    assert isinstance(short, Plan) and not short.embd_first  # a byte short
    alone = plan(SHAPE, Slot(A, 10 * GB), [Slot(B, 10 * GB)], CTX)
    assert isinstance(alone, Plan) and not alone.embd_first  # no worker: the host has it
    # --tensor-split: the same rule for the first node it names
    given = plan(SHAPE, Slot(A, GB), [Trusted(B, GB, rtt_ms=1), Trusted(C, GB, rtt_ms=2)], CTX, split=[1, 1, 3])
    assert isinstance(given, Plan) and given.embd_first
    small = plan(SHAPE, Slot(A, GB), [Trusted(B, _fits(2), rtt_ms=1), Trusted(C, _fits(2), rtt_ms=2)], CTX,
                 split=[1, 1, 3])  # fmt: skip
    assert isinstance(small, Plan) and not small.embd_first
    none = plan(SHAPE, Slot(A, GB), [Trusted(B, GB, rtt_ms=1), Trusted(C, GB, rtt_ms=2)], CTX, split=[0, 1, 3])
    assert isinstance(none, Plan) and not none.embd_first  # the first node named takes no layer: not layer 0 either
    # a first worker not trusted with prompts (below host scope) gets embedding rows, never token ids
    wary = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(6) + SHAPE.embd_bytes, rtt_ms=1)], CTX)
    assert isinstance(wary, Plan) and not wary.embd_first
    wary_split = plan(SHAPE, Slot(A, GB), [Slot(B, GB, rtt_ms=1), Slot(C, GB, rtt_ms=2, prompts=True)], CTX,
                      split=[1, 1, 3])  # fmt: skip
    assert isinstance(wary_split, Plan) and not wary_split.embd_first


def test_tensor_split_override() -> None:
    p = plan(SHAPE, Slot(A, GB), [Slot(B, GB, rtt_ms=1), Slot(C, GB, rtt_ms=2)], CTX, split=[1, 1, 3])
    assert isinstance(p, Plan) and [(a.node, a.count) for a in p.assignments] == [(B, 2), (C, 2), (A, 6)]
    w = plan(SHAPE, Slot(A, GB), [], CTX, split=[1, 1])  # a split that names more devices than the mesh has
    assert w == Waiting(0, 0, why="--tensor-split names 2 devices, the mesh has 1 nodes")
    assert w.message() == "waiting for more peers — --tensor-split names 2 devices, the mesh has 1 nodes"
    with pytest.raises(ValueError):  # the CLI refuses these before any node starts
        plan(SHAPE, Slot(A, GB), [], CTX, split=[0, 0])


def test_shape_of_the_test_model(tiny_model: Path) -> None:
    from meshllm.llama.gguf import read_header
    from meshllm.serve.fetch.modelfiles import model_shape

    s = model_shape(read_header(tiny_model))
    assert s.n_layer == 18 and s.n_embd == 640 and s.n_vocab == 262_144
    assert s.output_bytes == s.embd_bytes == 178_257_920  # tied: the output is a copy of the embedding
    assert s.total_bytes > tiny_model.stat().st_size  # the copy counts twice


def test_plan_debounce_first_at_once_and_urgent_when_broken() -> None:
    from meshllm.proto.debounce import Debouncer
    from meshllm.proto.planner import plan_broken

    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    p1 = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(8)), Slot(C, _fits(8))], CTX)
    p2 = plan(SHAPE, Slot(A, host_cap), [Slot(C, _fits(8))], CTX)
    assert isinstance(p1, Plan) and isinstance(p2, Plan) and p1 != p2
    d = Debouncer[Plan | Waiting](2.0, first_at_once=True)
    assert d.propose(p1, 0.0) == p1  # the first plan needs no wait
    assert d.propose(p2, 1.0) == p1 and d.propose(p2, 2.9) == p1  # a change waits ...
    assert d.propose(p2, 3.0) == p2  # ... until it has held for 2 s
    worker = p2.workers[0].node
    assert plan_broken(p2, {A}) and not plan_broken(p2, {A, worker})
    assert d.propose(p1, 3.1, urgent=True) == p1  # a broken plan is replaced at once


def test_a_plan_the_host_already_runs_or_one_that_ends_a_wait_is_adopted_at_once() -> None:
    """A worker the host's running plan names follows it without its own debounce (the
    host's llama-server waits for its key); a node that served nothing while it waited for memory takes the first
    plan that runs. Otherwise a change waits (a join burst would cost reloads)."""
    from meshllm.proto.planner import adopt_at_once

    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    p1 = plan(SHAPE, Slot(A, host_cap), [Slot(B, _fits(8)), Slot(C, _fits(8))], CTX)
    p2 = plan(SHAPE, Slot(A, host_cap), [Slot(C, _fits(8))], CTX)
    wait = plan(SHAPE, Slot(A, host_cap), [], CTX)
    assert isinstance(p1, Plan) and isinstance(p2, Plan) and isinstance(wait, Waiting)
    alive = {A, B, C}
    runs = tuple(a.node for a in p2.assignments)
    assert not adopt_at_once(p1, p2, alive, None)  # a change on the host itself: it waits
    assert not adopt_at_once(p1, p2, alive, tuple(a.node for a in p1.assignments))  # the host runs another one
    assert adopt_at_once(p1, p2, alive, runs)  # ... and once it runs this one, we follow at once
    assert adopt_at_once(wait, p2, alive, None)  # nothing served: the first plan that runs
    assert not adopt_at_once(wait, wait, alive, None) and not adopt_at_once(p2, wait, alive, None)
    assert adopt_at_once(p1, p2, {A, C}, None)  # p1's B is gone


def test_serving_host_is_a_connected_peer_announcing_the_model() -> None:
    import time

    from meshllm.proto import admission as adm
    from meshllm.proto import crypto
    from meshllm.proto.meshcore import MeshCore
    from meshllm.proto.record import ModelFacts, PeerRecord

    founder, other = crypto.new_key(), crypto.new_key()
    now = time.time()
    chain = adm.found(founder, now)
    core = MeshCore(key=founder, mesh_id=chain[0][0], chain=chain, incarnation=1, now=now)
    facts = ModelFacts("ab" * 32, 1, 1, "tiny")
    rec = PeerRecord(crypto.node_id(other), 1, 1, role="host", state="serving", model=facts,
                     chain=tuple(adm.admit(founder, chain, crypto.node_id(other), now)))  # fmt: skip
    core.table.merge_record(rec.to_wire(other), now)
    assert core.serving_host("tiny", now) is None  # known, but not connected
    core.on_connected(crypto.node_id(other), now)
    assert core.serving_host("tiny", now) == core.serving_host(None, now) == crypto.node_id(other)
    assert core.serving_host("other-model", now) is None


def test_requests_go_to_the_elected_host_never_to_a_self_claim() -> None:
    """A client- or worker-scoped member that gossips "host, serving" (with any capacity, listed first in
    the table) gets no request: a node routes to the host its own election picks among host-scoped records, and
    with the real host gone it routes nowhere rather than to the claimant; the claimant's model adds no name."""
    import time

    from meshllm.proto import admission as adm
    from meshllm.proto import crypto
    from meshllm.proto import token as tok
    from meshllm.proto.meshcore import MeshCore
    from meshllm.proto.record import ModelFacts, PeerRecord

    founder, host, liar_c, liar_w = (crypto.new_key() for _ in range(4))
    now = time.time()
    chain = adm.found(founder, now)
    core = MeshCore(key=founder, mesh_id=chain[0][0], chain=chain, incarnation=1, now=now)  # a lite client's view
    facts = ModelFacts("ab" * 32, 1, 1, "tiny")

    def rec(key: crypto.Ed25519PrivateKey, scope: tok.Scope, cap: int, model: ModelFacts = facts,
            seq: int = 1) -> bytes:  # fmt: skip
        node = crypto.node_id(key)
        return PeerRecord(node, 1, seq, role="host", state="serving", model=model, capacity=cap,
                          chain=tuple(adm.admit(founder, chain, node, now, scope))).to_wire(key)  # fmt: skip

    for key, scope in ((liar_c, tok.Scope.CLIENT), (liar_w, tok.Scope.WORKER)):  # first in table order
        core.table.merge_record(rec(key, scope, 2**62), now)
        core.on_connected(crypto.node_id(key), now)
    assert core.serving_host(None, now) is None and core.serving_host("tiny", now) is None
    assert core.served_models(now) == []
    core.table.merge_record(rec(host, tok.Scope.HOST, 10), now)
    core.on_connected(crypto.node_id(host), now)
    assert core.serving_host("tiny", now) == core.serving_host(None, now) == crypto.node_id(host)
    assert core.served_models(now) == ["tiny"]
    # a liar announcing a model of its own under another name adds no name and gets nothing
    core.table.merge_record(rec(liar_c, tok.Scope.CLIENT, 2**62, ModelFacts("cd" * 32, 1, 1, "mine"), seq=2), now)
    assert core.table.entries[crypto.node_id(liar_c)].record.model.source == "mine"  # type: ignore[union-attr]
    assert core.serving_host("mine", now) is None and "mine" not in core.served_models(now)
    # the reason every node gives for a host that cannot serve is the elected host's own, never a
    # claimant's text
    liar = crypto.node_id(liar_w)
    core.table.merge_record(PeerRecord(liar, 1, 3, role="host", state="serving", model=facts, capacity=2**62,
                                       why="the mesh moved: use http://evil.example",
                                       chain=tuple(adm.admit(founder, chain, liar, now, tok.Scope.WORKER))
                                       ).to_wire(liar_w), now)  # fmt: skip
    rec = core.host_record(now)
    assert rec is not None and rec.node == crypto.node_id(host) and rec.why == ""


@pytest.mark.parametrize(
    "counts",
    [(18, 0), (17, 1), (9, 9), (1, 17), (0, 18), (6, 6, 6), (12, 6, 0), (1, 1, 16), (10, 8, 0), (3, 0, 15)],
    ids=lambda c: "+".join(map(str, c)),
)
def test_every_layer_lands_where_planned_and_the_output_on_the_host(counts: tuple[int, ...]) -> None:
    """For every plan shape (host last with 0, some or most layers; 1 and 2 workers), the split we hand llama.cpp
    puts each repeating layer on its planned device and the output layer on the host: logits never cross a link."""
    nodes = [bytes([i]) * 32 for i in range(len(counts))]
    first = [sum(counts[:i]) for i in range(len(counts))]
    p = Plan(nodes[-1], tuple(Assignment(n, f, c, 0) for n, f, c in zip(nodes, first, counts, strict=True)), ())
    n_layer = sum(counts)
    for a_i, a in enumerate(p.assignments):
        for layer in range(a.first, a.first + a.count):
            assert device_of_unit(p.tensor_split, layer, n_layer) == a_i, (layer, p.tensor_split)
    assert device_of_unit(p.tensor_split, n_layer, n_layer) == len(counts) - 1  # the output: on the host
    # what the plan used to hand over (plain counts) sent the output to a worker when the host held no layer
    if counts[-1] == 0:
        assert device_of_unit(tuple(counts), n_layer, n_layer) != len(counts) - 1


def test_slots_for_takes_the_nodes_with_the_model_and_the_hosts_rtts() -> None:
    from meshllm.proto.layout import Slot
    from meshllm.proto.planner import slots_for
    from meshllm.proto.record import ModelFacts, PeerRecord, Role
    from meshllm.proto.token import Scope

    def chain(scope: Scope) -> tuple[tuple[bytes, bytes, bytes, int, int, bytes], ...]:
        return ((b"", b"", b"", 0, 0, int(scope), b""),)  # slots_for reads the scope; gossip verified the chain

    ids = [bytes([i]) * 32 for i in range(6)]
    same, other = ModelFacts("aa", 1, 18, "m"), ModelFacts("bb", 1, 18, "m")
    host = PeerRecord(ids[0], 1, 1, role=Role.HOST, capacity=10, model=same, rtt_ms={ids[1]: 3.5},
                      chain=chain(Scope.HOST))  # fmt: skip
    worker = chain(Scope.WORKER)
    recs = [
        host,
        PeerRecord(ids[1], 1, 1, role=Role.WORKER, capacity=5, model=same, chain=worker),
        PeerRecord(ids[2], 1, 1, role=Role.WORKER, capacity=5, model=other, chain=worker),  # another model
        PeerRecord(ids[3], 1, 1, role=Role.CLIENT, capacity=0, model=same, chain=worker),  # a lite client
        PeerRecord(ids[4], 1, 1, role=Role.WORKER, capacity=7, model=same, chain=worker),  # no RTT measured yet
        PeerRecord(ids[5], 1, 1, role=Role.WORKER, capacity=9, model=same, chain=chain(Scope.CLIENT)),  # API only
    ]
    assert slots_for(recs, ids[0], "aa") == (Slot(ids[0], 10), [Slot(ids[1], 5, 3.5), Slot(ids[4], 7, 0.0)])
    assert slots_for(recs[1:], ids[0], "aa") is None  # the host's own record missing
    # a host-scoped worker is trusted with prompts (it may take the token embedding), a worker-scoped not
    trusted = PeerRecord(ids[1], 1, 2, role=Role.WORKER, capacity=5, model=same, chain=chain(Scope.HOST))
    got = slots_for([host, trusted, recs[4]], ids[0], "aa")
    assert got is not None and [s.prompts for s in got[1]] == [True, False]


def test_a_node_with_several_devices_gets_an_entry_for_each() -> None:
    assert spread(10, ()) == [10] and spread(10, (5,)) == [10]
    assert spread(10, (1, 1)) == [5, 5] and spread(7, (1, 1)) == [4, 3] and spread(3, (2, 1, 1)) == [1, 1, 1]
    assert spread(4, (2, 1, 1)) == [2, 1, 1]
    assert spread(5, (0, 0)) == [5, 0]
    for count in range(0, 40):
        for shares in [(3, 1), (1, 1, 1), (80, 60), (7, 0, 2)]:
            parts = spread(count, shares)
            assert sum(parts) == count and len(parts) == len(shares)
    # a worker with two GPUs and a host with two: four llama.cpp devices, the output on the host's last GPU
    host = host_fixed_bytes(SHAPE, CTX) + SHAPE.compute_bytes(CTX, output=False) + 4 * SHAPE.layer_cost(0, CTX)
    w = Slot(B, 2 * _fits(3), rtt_ms=1, shares=(_fits(3), _fits(3)))
    p = plan(SHAPE, Slot(A, host, shares=(host // 2, host - host // 2)), [w], CTX)
    assert isinstance(p, Plan) and [a.count for a in p.assignments] == [6, 4]
    assert [a.shares for a in p.assignments] == [w.shares, (host // 2, host - host // 2)]
    split = p.tensor_split
    assert len(split) == 4 and sum(split) == SHAPE.n_layer + 1
    for a_i, devices in ((0, (0, 1)), (1, (2, 3))):
        a = p.assignments[a_i]
        assert {device_of_unit(split, layer, SHAPE.n_layer) for layer in range(a.first, a.first + a.count)} <= set(
            devices
        )
    assert device_of_unit(split, SHAPE.n_layer, SHAPE.n_layer) == 3  # the output: the host's last device


def test_each_device_pays_its_compute_buffer() -> None:
    host = Slot(A, host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX))
    one = plan(SHAPE, host, [Slot(B, _fits(6), rtt_ms=1)], CTX)
    two = plan(SHAPE, host, [Slot(B, _fits(6), rtt_ms=1, shares=(_fits(3), _fits(6) - _fits(3)))], CTX)
    assert isinstance(one, Plan) and one.assignments[0].count == 6  # one device: it fits exactly
    assert isinstance(two, Waiting)  # the same memory on two devices holds two compute buffers: no longer fits
    assert two.need - plan(SHAPE, host, [Slot(B, 1, rtt_ms=1)], CTX).need == SHAPE.compute_bytes(CTX, output=False)  # type: ignore[union-attr]


def test_equal_workers_keep_the_layers_they_hold_across_replans() -> None:
    """Two equal workers swapped ranges 3-5 times on a busy machine and each fetched both. What each holds
    is an input: the same workers are ordered by the layers they hold, so a re-plan moves none of them."""
    host_cap = host_fixed_bytes(SHAPE, CTX) + 4 * SHAPE.layer_cost(0, CTX)
    lo, hi = sorted([B, C])
    fresh = plan(SHAPE, Slot(A, host_cap), [Slot(lo, _fits(3)), Slot(hi, _fits(3))], CTX)
    assert isinstance(fresh, Plan)
    assert [(a.node, a.first, a.count) for a in fresh.assignments] == [(lo, 0, 3), (hi, 3, 3), (A, 6, 4)]  # by id
    held = plan(SHAPE, Slot(A, host_cap), [Slot(lo, _fits(3), held_from=3), Slot(hi, _fits(3), held_from=0)], CTX)
    assert isinstance(held, Plan)
    assert [(a.node, a.first, a.count) for a in held.assignments] == [(hi, 0, 3), (lo, 3, 3), (A, 6, 4)]
    one = plan(SHAPE, Slot(A, host_cap), [Slot(lo, _fits(3)), Slot(hi, _fits(3), held_from=0)], CTX)
    assert isinstance(one, Plan) and one.assignments[0].node == hi  # a holder first, one holding nothing after
    # where the holders' order cannot place every layer (unequal workers), the plan stays as it would be
    as_was = plan(SHAPE, Slot(A, host_cap), [Slot(lo, _fits(4)), Slot(hi, _fits(2))], CTX)
    got = plan(SHAPE, Slot(A, host_cap), [Slot(lo, _fits(4), held_from=4), Slot(hi, _fits(2), held_from=0)], CTX)
    assert isinstance(as_was, Plan) and isinstance(got, Plan) and sum(a.count for a in got.assignments) == 10
    assert [(a.node, a.first, a.count) for a in got.assignments] in (
        [(a.node, a.first, a.count) for a in as_was.assignments],
        [(hi, 0, 2), (lo, 2, 4), (A, 6, 4)],
    )


MOE = ModelShape(
    n_layer=10, layer_bytes=(100 * MiB,) * 10, embd_bytes=200 * MiB, output_bytes=200 * MiB, other_bytes=MiB,
    kv_bytes_per_token_layer=1024, n_embd=1024, n_vocab=32000, expert_bytes=(80 * MiB,) * 10,
)  # fmt: skip


def test_a_host_short_of_accelerator_memory_keeps_the_fewest_layers_experts_in_ram() -> None:
    """Pooled accelerator memory first (no spill while it holds the model); short of it, the host keeps the
    routed experts of as few layers as needed in its RAM (--n-cpu-moe as tensor overrides); RAM too short: waiting."""
    whole = host_fixed_bytes(MOE, CTX) + sum(MOE.layer_cost(i, CTX) for i in range(10))
    fits = plan(MOE, Slot(A, whole, ram=GB), [], CTX)
    assert isinstance(fits, Plan) and fits.assignments[0].spilled == ()
    short = plan(MOE, Slot(A, whole - 100 * MiB, ram=GB), [], CTX)  # 100 MiB short: two layers' experts (80 each)
    assert isinstance(short, Plan)
    (h,) = short.assignments
    assert (h.count, h.spilled, h.ram_bytes) == (10, (0, 1), 160 * MiB) and h.bytes <= whole - 100 * MiB
    assert isinstance(plan(MOE, Slot(A, whole - 100 * MiB, ram=100 * MiB), [], CTX), Waiting)  # RAM for one only
    assert isinstance(plan(MOE, Slot(A, whole - 100 * MiB), [], CTX), Waiting)  # no RAM offered
    dense = replace(MOE, expert_bytes=())  # no experts to move: its first layer whole in RAM
    d = plan(dense, Slot(A, whole - 100 * MiB, ram=GB), [], CTX)
    assert isinstance(d, Plan) and (d.ram_layers, d.n_gpu_layers, d.tensor_split) == (1, 10, (10,))
    assert d.assignments[0].ram_bytes == dense.layer_cost(0, CTX) and d.assignments[0].spilled == ()
    assert isinstance(plan(dense, Slot(A, whole - 100 * MiB, ram=100 * MiB), [], CTX), Waiting)  # + a buffer: short
    # a worker's accelerator memory is used before any RAM: it takes its most, the host spills only what is left
    pooled = plan(MOE, Slot(A, whole - 500 * MiB, ram=GB), [Slot(B, _fits(3))], CTX)
    assert isinstance(pooled, Plan)
    w, h = pooled.assignments
    assert (w.node, w.first, w.count, w.spilled) == (B, 0, 3, ())
    assert h.count == 7 and len(h.spilled) == 3 and h.spilled == (3, 4, 5) and h.ram_bytes == 240 * MiB
    assert experts_override(h.spilled) == r"blk\.(3|4|5)\.ffn_(up|down|gate)_exps=CPU"


@given(host_mb=st.integers(100, 3000), workers=st.lists(st.integers(0, 1500), max_size=3),
       ram_mb=st.integers(0, 2000), moe=st.booleans(), ctx=st.sampled_from([512, 4096]))  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_a_plan_never_exceeds_a_nodes_cap(host_mb: int, workers: list[int], ram_mb: int, moe: bool, ctx: int) -> None:
    """A node capped at 0.4 GB became host with 0.45 GB planned. Whatever the memory, a plan puts on each
    node at most what it offers (its RAM for experts apart), or the mesh waits."""
    shape = MOE if moe else SHAPE
    host = Slot(A, host_mb * MiB, ram=ram_mb * MiB)
    others = [Slot(bytes([10 + i]) * 32, w * MiB, rtt_ms=1.0) for i, w in enumerate(workers)]
    p = plan(shape, host, others, ctx)
    if isinstance(p, Plan):
        caps = {s.node: s for s in [host, *others]}
        for a in p.assignments:
            assert a.bytes <= caps[a.node].capacity, (a, caps[a.node])
            assert a.ram_bytes <= caps[a.node].ram


def test_a_spilling_plan_keeps_its_workers_ranges_and_covers_each_layer_once() -> None:
    """With two equal workers that hold their layers in the other order, and a host that spills:
    the workers are reordered within their own range (not the range a plan without spill would have given them),
    every layer is placed once."""
    host_cap = host_fixed_bytes(MOE, CTX) + 3 * MOE.layer_cost(0, CTX)  # short: the host must spill
    lo, hi = sorted([B, C])
    p = plan(MOE, Slot(A, host_cap, ram=GB), [Slot(lo, _fits(3), held_from=3), Slot(hi, _fits(3), held_from=0)],
             CTX)  # fmt: skip
    assert isinstance(p, Plan)
    spans = [(a.node, a.first, a.count) for a in p.assignments]
    assert spans[:2] == [(hi, 0, 3), (lo, 3, 3)] and spans[2][1:] == (6, 4), spans
    assert p.assignments[2].spilled and sum(a.count for a in p.assignments) == MOE.n_layer


def test_a_host_short_of_ram_lets_its_workers_keep_experts_in_theirs() -> None:
    """A worker with an accelerator serves its CPU too (its rpc-server's last device, an entry 0 in the
    split) and keeps the routed experts of its first layers there: the fewest expert bytes in RAM over the mesh, the
    host's RAM where that costs no more; a worker with no RAM offered serves no CPU device."""
    per = MOE.compute_bytes(CTX, output=False)
    host_cap = host_fixed_bytes(MOE, CTX, gpu=True) + sum(MOE.layer_cost(i, CTX) for i in range(5)) - 160 * MiB
    worker = 5 * MOE.layer_cost(0, CTX) + per - 160 * MiB  # each two layers' experts short of five layers
    p = plan(MOE, Slot(A, host_cap, ram=GB, gpu=True), [Slot(B, worker, ram=GB, gpu=True)], CTX)
    assert isinstance(p, Plan) and p.tensor_split == (5, 0, 6)  # the worker's GPU, its CPU, the host (+ output)
    w, h = p.assignments
    assert (w.spilled, h.spilled, w.ram_bytes, h.ram_bytes) == ((0, 1), (5, 6), 160 * MiB, 160 * MiB) and w.cpu_last
    # the host's RAM for one layer's experts: it takes four layers, the worker six with four layers' experts in RAM
    q = plan(MOE, Slot(A, host_cap, ram=80 * MiB + per, gpu=True), [Slot(B, worker, ram=GB, gpu=True)], CTX)
    assert isinstance(q, Plan)
    assert [(a.first, a.count, a.spilled) for a in q.assignments] == [(0, 6, (0, 1, 2, 3)), (6, 4, (6,))]
    assert isinstance(plan(MOE, Slot(A, host_cap, ram=80 * MiB + per, gpu=True),
                           [Slot(B, worker, ram=200 * MiB, gpu=True)], CTX), Waiting)  # fmt: skip
    # where the worker's accelerator holds its five whole layers, the host alone keeps experts in RAM
    r = plan(MOE, Slot(A, host_cap, ram=GB, gpu=True), [Slot(B, worker + 160 * MiB, ram=GB, gpu=True)], CTX)
    assert isinstance(r, Plan) and [a.spilled for a in r.assignments] == [(), (5, 6)]
    # no RAM offered by the worker: no CPU device, no entry for it, its experts never in RAM
    s_ = plan(MOE, Slot(A, host_cap, ram=GB, gpu=True), [Slot(B, worker + 160 * MiB, gpu=True)], CTX)
    assert isinstance(s_, Plan) and s_.tensor_split == (5, 6) and not s_.assignments[0].cpu_last


def test_a_forced_split_keeps_a_workers_cpu_device_entry() -> None:
    """--tensor-split over GPU workers that serve their CPU too: each worker's CPU device keeps its entry 0, or every
    later entry shifts one device left and layers land on the workers' CPUs (seen on the device: 4 nodes at 13 tok/s,
    a 20th of llama.cpp in one process)."""
    cap = 40 * GB
    p = plan(SHAPE, Slot(A, cap, ram=GB, gpu=True), [Slot(B, cap, ram=GB, gpu=True), Slot(C, cap, ram=GB, gpu=True)],
             CTX, split=[1.0, 1.0, 1.0])  # fmt: skip
    assert isinstance(p, Plan) and all(a.cpu_last for a in p.workers)
    counts = [a.count for a in p.assignments]
    assert p.tensor_split == (counts[0], 0, counts[1], 0, counts[2] + 1), p.tensor_split


def test_layers_whole_in_the_hosts_ram_come_first_and_the_devices_split_the_rest() -> None:
    """Whole layers in RAM are llama.cpp's --n-gpu-layers: its CPU takes layers [0, ram_layers) ahead of
    every device; the split spreads the offloaded units only, so each offloaded layer lands where the plan says."""
    host_cap = host_fixed_bytes(SHAPE, CTX, gpu=True) + 4 * SHAPE.layer_cost(0, CTX)
    p = plan(SHAPE, Slot(A, host_cap, ram=GB, gpu=True), [Slot(B, _fits(3), ram=GB, gpu=True)], CTX)
    assert isinstance(p, Plan) and p.ram_layers == 3 and p.n_gpu_layers == 8
    assert [(a.node, a.first, a.count) for a in p.assignments] == [(B, 3, 3), (A, 6, 4)]
    assert p.tensor_split == (3, 0, 5) and not p.embd_first
    owners = [device_of_unit(p.tensor_split, i - p.ram_layers, SHAPE.n_layer - p.ram_layers) for i in range(3, 10)]
    assert owners == [0, 0, 0, 2, 2, 2, 2]  # the worker's GPU, then the host (its CPU device, 1, holds none)
    plain = plan(SHAPE, Slot(A, host_cap, ram=GB, gpu=True), [Slot(B, _fits(6), ram=GB, gpu=True)], CTX)
    assert isinstance(plain, Plan) and plain.ram_layers == 0 and plain.n_gpu_layers is None


@given(
    host_mb=st.integers(100, 3000),
    workers=st.lists(st.tuples(st.integers(0, 1500), st.integers(0, 1500), st.booleans()), max_size=3),
    ram_mb=st.integers(0, 2000),
    moe=st.booleans(),
    ctx=st.sampled_from([512, 4096]),
)
@settings(max_examples=300, deadline=None)
def test_ram_is_used_only_where_accelerators_are_short_and_every_layer_once(
    host_mb: int, workers: list[tuple[int, int, bool]], ram_mb: int, moe: bool, ctx: int
) -> None:
    """With RAM offered, a plan is the plan without RAM wherever that one places the model; otherwise every
    layer is placed once, no node's accelerator or RAM holds more than it offers, and the split covers the units."""
    shape = MOE if moe else SHAPE
    host = Slot(A, host_mb * MiB, ram=ram_mb * MiB, gpu=True)
    others = [Slot(bytes([10 + i]) * 32, w * MiB, rtt_ms=1.0, ram=r * MiB, gpu=g) for i, (w, r, g) in
              enumerate(workers)]  # fmt: skip
    p = plan(shape, host, others, ctx)
    without = plan(shape, replace(host, ram=0), [replace(o, ram=0) for o in others], ctx)
    if isinstance(without, Plan) and all(o.gpu for o in others):  # (CPU workers: after the GPUs' RAM, below)
        assert isinstance(p, Plan) and [(a.node, a.first, a.count, a.spilled) for a in p.assignments] == [
            (a.node, a.first, a.count, ()) for a in without.assignments
        ]
    if not isinstance(p, Plan):
        return
    caps = {s.node: s for s in [host, *others]}
    covered = list(range(p.ram_layers)) + [i for a in p.assignments for i in range(a.first, a.first + a.count)]
    assert covered == list(range(shape.n_layer))
    for a in p.assignments:
        assert a.bytes <= caps[a.node].capacity and a.ram_bytes <= caps[a.node].ram, (a, caps[a.node])
        assert set(a.spilled) <= set(range(a.first, a.first + a.count))
    assert sum(p.tensor_split) == shape.n_layer - p.ram_layers + 1


@given(n=st.integers(1, 6), host=st.tuples(st.integers(0, 900), st.integers(0, 600)),
       workers=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 600)), max_size=2),
       experts=st.lists(st.integers(0, 90), min_size=6, max_size=6))  # fmt: skip
@settings(max_examples=300, deadline=None)
def test_the_fewest_expert_bytes_in_ram_by_brute_force(
    n: int, host: tuple[int, int], workers: list[tuple[int, int]], experts: list[int]
) -> None:
    """The plan keeps no more expert bytes in RAM than the best of every way to cut the layers into
    contiguous ranges (each node spilling the first of its range), found by trying them all on a small model."""
    from itertools import combinations_with_replacement

    shape = replace(MOE, n_layer=n, layer_bytes=(100 * MiB,) * n, expert_bytes=tuple(e * MiB for e in experts[:n]))
    per = shape.compute_bytes(CTX, output=False)
    hs = Slot(A, host_fixed_bytes(shape, CTX, gpu=True) + host[0] * MiB, ram=host[1] * MiB + per, gpu=True)
    ws = [Slot(bytes([10 + i]) * 32, w * MiB + per, rtt_ms=1.0, ram=r * MiB + per, gpu=True)
          for i, (w, r) in enumerate(workers)]  # fmt: skip
    p = plan(shape, hs, ws, CTX)
    order = sorted(ws, key=lambda s: (-s.capacity, s.node))  # the planner's order for near nodes

    def least(a: int, b: int, vram: int, ram: int) -> int | None:
        for k in range(b - a + 1):
            spill = sum(shape.experts(i) for i in range(a, a + k))
            if spill <= ram and sum(shape.layer_cost(i, CTX) for i in range(a, b)) - spill <= vram:
                return spill
        return None

    best: int | None = None
    budgets = [(s.capacity - per, s.ram - per) for s in order] + [(host[0] * MiB, host[1] * MiB)]
    for cuts in combinations_with_replacement(range(n + 1), len(order)):
        bounds = [0, *cuts, n]
        spills = [least(bounds[i], bounds[i + 1], *budgets[i]) for i in range(len(budgets))]
        if all(x is not None for x in spills):
            total = sum(x for x in spills if x is not None)
            best = total if best is None else min(best, total)
    if best is None:
        assert not isinstance(p, Plan) or p.ram_layers > 0
    else:
        assert isinstance(p, Plan) and p.ram_layers == 0
        assert sum(a.ram_bytes for a in p.assignments) == best, (p, best)


def test_accelerators_host_and_their_ram_comes_before_cpu_nodes() -> None:
    """C: a GPU node and a CPU node with far more (RAM) capacity: the GPU node hosts (the plan keeps the
    per-token work on accelerators), and keeps experts in its own RAM rather than handing whole layers to the CPU
    node; the CPU node takes layers only where the GPU's memory and RAM are short. Between nodes of one kind, the
    capacity rule holds (and a sitting CPU host yields to a GPU node at once)."""
    gpu, cpu = Candidate(A, 10 * GB, "f", gpu=True), Candidate(B, 200 * GB, "f")
    assert elect([gpu, cpu], "f") == A and elect([gpu, cpu], "f", sitting=B) == A
    assert elect([Candidate(A, 10 * GB, "f"), cpu], "f") == B  # both CPU nodes: the most memory
    assert elect([gpu, Candidate(C, 11 * GB, "f", gpu=True)], "f", sitting=A) == A  # within the margin
    whole = host_fixed_bytes(MOE, CTX, gpu=True) + sum(MOE.layer_cost(i, CTX) for i in range(10))
    p = plan(MOE, Slot(A, whole - 100 * MiB, ram=GB, gpu=True), [Slot(B, 200 * GB)], CTX)
    assert isinstance(p, Plan) and [a.node for a in p.assignments] == [A] and p.standby == (B,)
    assert p.assignments[0].spilled == (0, 1)
    q = plan(MOE, Slot(A, whole - 100 * MiB, gpu=True), [Slot(B, 200 * GB)], CTX)  # no RAM offered: the CPU node
    assert isinstance(q, Plan) and [a.node for a in q.assignments] == [B, A] and q.assignments[1].spilled == ()
