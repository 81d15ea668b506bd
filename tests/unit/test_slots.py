"""Slots: who runs next on the host's llama-server (proto/slots.py), and how many slots of what context a mesh runs
(sizing.size)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.proto import slots as sl
from meshllm.proto.layout import GB, MiB, ModelShape, Plan, Slot, Waiting
from meshllm.proto.sizing import MAX_AUTO_SLOTS, size, with_cache

# ------------------------------------------------------------------------------------------------ the scheduler


def test_admits_up_to_the_slots_then_queues() -> None:
    s = sl.Slots(total=2, queue_max=4)
    assert isinstance(s.arrive("a", 1, 0.0), sl.Admitted)
    assert isinstance(s.arrive("a", 1, 0.0), sl.Admitted)
    q = s.arrive("a", 1, 0.0)
    assert isinstance(q, sl.Queued) and s.busy == 2 and s.queued == 1


def test_a_burst_does_not_starve_another_source() -> None:
    """Source a queues ten requests, then b one: b's goes next, not after a's ten."""
    s = sl.Slots(total=2, queue_max=64)
    first = [s.arrive("a", 1, 0.0) for _ in range(12)]
    b = s.arrive("b", 1, 1.0)
    assert isinstance(b, sl.Queued)
    admitted = s.leave(first[0].ticket.id, 2.0)  # type: ignore[union-attr]
    assert [t.source for t in admitted] == ["b"]
    # and a's own requests keep their order
    admitted = s.leave(first[1].ticket.id, 3.0)  # type: ignore[union-attr]
    assert admitted == [first[2].ticket]  # type: ignore[union-attr]


def test_round_robin_between_sources_with_equal_running() -> None:
    s = sl.Slots(total=1, queue_max=64)
    run = s.arrive("x", 1, 0.0)
    for src in ("a", "a", "b", "b", "c"):
        s.arrive(src, 1, 0.0)
    order = []
    cur = run.ticket.id  # type: ignore[union-attr]
    for i in range(5):
        (t,) = s.leave(cur, 1.0 + i)
        order.append(t.source)
        cur = t.id
    assert order == ["a", "b", "c", "a", "b"]


def test_full_queue_refuses_with_retry_after() -> None:
    s = sl.Slots(total=1, queue_max=1)
    s.arrive("a", 1, 0.0)
    assert isinstance(s.arrive("a", 1, 0.0), sl.Queued)
    r = s.arrive("a", 1, 0.0)
    assert isinstance(r, sl.Refused) and sl.RETRY_MIN_S <= r.retry_after_s <= sl.RETRY_MAX_S
    assert s.queued == 1 and s.refused == 1


def test_a_full_queue_makes_room_for_another_source() -> None:
    """The queue is full of a's requests: b's newcomer displaces a's newest, not b refused."""
    s = sl.Slots(total=1, queue_max=3)
    s.arrive("a", 1, 0.0)
    waiting = [s.arrive("a", 1, 0.0) for _ in range(3)]
    got = s.arrive("b", 1, 1.0)
    assert isinstance(got, sl.Queued) and got.displaced == waiting[-1].ticket  # type: ignore[union-attr]
    assert s.queued == 3
    # b cannot push out more than its fair share: with b 1 waiting and a 2, the next b is refused
    assert isinstance(s.arrive("b", 1, 1.0), sl.Refused)


def test_a_request_for_n_completions_takes_n_slots_and_is_not_jumped() -> None:
    s = sl.Slots(total=4, queue_max=8)
    one = s.arrive("a", 1, 0.0)
    two = s.arrive("a", 2, 0.0)
    assert isinstance(two, sl.Admitted) and s.busy == 3
    big = s.arrive("b", 3, 0.0)  # 3 > 1 free: waits
    small = s.arrive("c", 1, 0.0)  # would fit, but comes after b's
    assert isinstance(big, sl.Queued) and isinstance(small, sl.Queued)
    assert s.leave(one.ticket.id, 1.0) == []  # type: ignore[union-attr]  # 2 free: b's 3 still waits, c does not jump
    assert [t.source for t in s.leave(two.ticket.id, 2.0)] == ["b", "c"]  # type: ignore[union-attr]
    assert s.arrive("d", 99, 3.0).ticket.weight == 4  # type: ignore[union-attr]  # never more than all slots


def test_leaving_the_queue_and_resizing() -> None:
    s = sl.Slots(total=1, queue_max=4)
    run = s.arrive("a", 1, 0.0)
    q = s.arrive("b", 1, 0.0)
    assert s.leave(q.ticket.id, 1.0) == [] and s.queued == 0  # type: ignore[union-attr]  # a client gave up waiting
    q2 = s.arrive("b", 1, 1.0)
    assert s.resize(2, 8, 2.0) == [q2.ticket]  # type: ignore[union-attr]
    assert s.leave(run.ticket.id, 10.0) == [] and s.busy == 1  # type: ignore[union-attr]
    assert s.mean_s != 5.0  # the duration estimate follows what it saw


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 3), st.booleans()), max_size=60),
       st.integers(1, 4), st.integers(0, 6))  # fmt: skip
def test_never_more_than_the_slots_or_the_queue(ops: list[tuple[str, int, bool]], total: int, qmax: int) -> None:
    s = sl.Slots(total=total, queue_max=qmax)
    live: list[int] = []
    for i, (src, w, leave) in enumerate(ops):
        if leave and live:
            s.leave(live.pop(0), float(i))
        else:
            got = s.arrive(src, w, float(i))
            if not isinstance(got, sl.Refused):
                live.append(got.ticket.id)
            if isinstance(got, sl.Queued) and got.displaced is not None:
                live.remove(got.displaced.id)
        assert s.busy <= s.total and s.queued <= s.queue_max
        # nobody waits while its request would fit in free slots and nobody is ahead of it
        assert not s.waiting or s.busy + s.waiting[0].weight > s.total or len(s.waiting) > 1 or s.busy > 0


# ------------------------------------------------------------------------------------------------ sizing

SHAPE = ModelShape(
    n_layer=10, layer_bytes=(100 * MiB,) * 10, embd_bytes=200 * MiB, output_bytes=200 * MiB, other_bytes=MiB,
    kv_bytes_per_token_layer=2 * 1024, n_embd=1024, n_vocab=32000, n_ctx_train=32768,
)  # fmt: skip
A, B = bytes([1]) * 32, bytes([2]) * 32


def _kv(p: Plan | Waiting) -> int:
    assert isinstance(p, Plan)
    return sum(a.bytes for a in p.assignments)


def test_auto_fills_slots_then_context_within_the_share() -> None:
    p, s = size(SHAPE, Slot(A, 80 * GB), [], None, None)
    assert isinstance(p, Plan) and s.parallel == MAX_AUTO_SLOTS and s.ctx == SHAPE.n_ctx_train  # plenty: the most
    p, s = size(SHAPE, Slot(A, 4 * GB), [], None, None)
    assert isinstance(p, Plan) and s.parallel == MAX_AUTO_SLOTS and 4096 < s.ctx < SHAPE.n_ctx_train
    assert p.assignments[0].bytes <= 0.9 * 4 * GB  # the headroom is kept
    bigger = size(SHAPE, Slot(A, 4 * GB), [], MAX_AUTO_SLOTS, s.ctx + 256)[0]
    assert isinstance(bigger, Plan) and _kv(bigger) > _kv(p)  # the KV of every slot is charged
    assert size(SHAPE, Slot(A, 4 * GB), [], 2, 1024)[1] == size(SHAPE, Slot(A, 4 * GB), [], 2, 1024)[1]


def test_auto_never_draws_another_node_in() -> None:
    """The model fits the host alone at one 4k slot: auto sizes stay on the host, the worker stands by."""
    cap = int(1.6 * GB)
    p, s = size(SHAPE, Slot(A, cap), [Slot(B, 80 * GB)], None, None)
    assert isinstance(p, Plan) and [a.node for a in p.assignments] == [A] and p.standby == (B,)
    assert s.parallel >= 1 and s.ctx >= 4096


def test_the_workers_hold_the_kv_of_their_layers() -> None:
    p, _ = size(SHAPE, Slot(A, int(0.9 * GB)), [Slot(B, 2 * GB)], 4, 4096)
    assert isinstance(p, Plan)
    w = p.workers[0]
    assert w.bytes >= w.count * (SHAPE.layer_bytes[0] + SHAPE.kv_bytes_per_token_layer * 4 * 4096)


def test_an_explicit_size_that_does_not_fit_says_what_would() -> None:
    p, _ = size(SHAPE, Slot(A, 2 * GB), [], 64, 4096)
    assert isinstance(p, Waiting) and "--parallel 64 with --ctx-size 4096 needs" in p.message()
    k = int(p.why.split("--parallel ")[2].split()[0])
    assert isinstance(size(SHAPE, Slot(A, 2 * GB), [], k, 4096)[0], Plan)
    assert isinstance(size(SHAPE, Slot(A, 2 * GB), [], k + 1, 4096)[0], Waiting)
    p, _ = size(SHAPE, Slot(A, 2 * GB), [], 1, 32768 * 4)
    assert isinstance(p, Waiting) and "--ctx-size" in p.why.split(": ")[1]
    # a model that does not fit at all waits for memory, as before (no advice about slots)
    p, _ = size(SHAPE, Slot(A, GB // 2), [], 4, 4096)
    assert isinstance(p, Waiting) and not p.why


@pytest.mark.parametrize(("cache", "ratio"), [("f16", 1.0), ("q8_0", 34 / 64), ("q4_0", 18 / 64)])
def test_cache_types_charge_their_bytes(cache: str, ratio: float) -> None:
    assert with_cache(SHAPE, cache).kv_bytes_per_token_layer == pytest.approx(SHAPE.kv_bytes_per_token_layer * ratio)
    _, f16 = size(SHAPE, Slot(A, 4 * GB), [], 8, None)
    _, q = size(SHAPE, Slot(A, 4 * GB), [], 8, None, cache=cache)
    assert q.ctx >= f16.ctx and (q.ctx > f16.ctx or cache == "f16")


def test_unknown_trained_context_stays_at_the_base() -> None:
    shape = dataclasses.replace(SHAPE, n_ctx_train=0)
    _, s = size(shape, Slot(A, 80 * GB), [], None, None)
    assert s.ctx == 4096


def test_the_default_context_on_two_80gb_gpus_for_an_8b_model_is_at_least_32k() -> None:
    """Many clients at once, on the planner: Llama-3-8B's shape (Q4_K_M, 4.9 GB; GQA 8 KV heads of 128: 4 KiB of f16
    K+V per token and layer; trained for 131072) on a mesh of two 80 GB GPUs gets 8 slots of at least 32k tokens."""
    shape = ModelShape(
        n_layer=32, layer_bytes=(137 * MiB,) * 32, embd_bytes=282 * MiB, output_bytes=411 * MiB, other_bytes=MiB,
        kv_bytes_per_token_layer=2 * 8 * (128 + 128), n_embd=4096, n_vocab=128256, n_ctx_train=131072,
    )  # fmt: skip
    p, s = size(shape, Slot(A, 80 * GB), [Slot(B, 80 * GB)], None, None)
    assert isinstance(p, Plan) and s.parallel == MAX_AUTO_SLOTS and s.ctx >= 32768


def test_the_memory_of_sources_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client address of a --listen-all API is a source: their last service times are kept for the newest
    MAX_SOURCES only (a forgotten source ranks as never served, which only helps it)."""
    monkeypatch.setattr(sl, "MAX_SOURCES", 8)
    s = sl.Slots(total=1, queue_max=4)
    for i in range(20):
        t = s.arrive(f"client {i}", 1, float(i))
        s.leave(t.ticket.id, float(i) + 0.5)  # type: ignore[union-attr]
    assert list(s.last_served) == [f"client {i}" for i in range(12, 20)]


def test_the_source_running_fewest_slots_goes_first_even_if_served_more_lately() -> None:
    """(the mutation audit left it untested): the first rule of the rank is the slots a source runs now;
    the time it was last served only breaks ties. a runs two slots and was served before b; b runs none: b next."""
    s = sl.Slots(total=3, queue_max=64)
    a1, a2 = s.arrive("a", 1, 1.0), s.arrive("a", 1, 2.0)
    b1 = s.arrive("b", 1, 3.0)
    assert all(isinstance(x, sl.Admitted) for x in (a1, a2, b1))
    qa, qb = s.arrive("a", 1, 4.0), s.arrive("b", 1, 5.0)
    assert isinstance(qa, sl.Queued) and isinstance(qb, sl.Queued)
    admitted = s.leave(b1.ticket.id, 6.0)  # type: ignore[union-attr]
    assert admitted == [qb.ticket]  # a was served longer ago (2.0 < 3.0) but runs two slots, b none
