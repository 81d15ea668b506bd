"""Slots and context sized to fit, pure: ``--parallel auto`` and ``--ctx-size auto`` as the most slots (up to
MAX_AUTO_SLOTS) of the most context (from BASE_CTX up, in CTX_STEP steps, at most the model's trained context) whose
plan fits within AUTO_SHARE of every node's offer, with the KV cache type's bytes per cell (``CACHE_TYPES``)."""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass, replace

from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import (
    GB,
    ModelShape,
    Plan,
    Slot,
    Waiting,
)
from meshllm.proto.planner import MAX_RTT_MS, plan

# KV cache types llama-server takes (--cache-type-k/-v): bytes per block, elements per block (ggml's layouts)
CACHE_TYPES = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}


MAX_AUTO_SLOTS = 8  # --parallel auto: at most this many


BASE_CTX = 4096  # --ctx-size auto: no less than this per slot (or the model's trained context, when smaller)


AUTO_SHARE = 0.9  # what auto sizes may fill of each node's offer: the rest is headroom for what no estimate sees


CTX_STEP = 256  # llama.cpp pads a context to a multiple of 256


@dataclass(frozen=True)
class Sizing:
    """How many slots llama-server runs (--parallel) and the context of each (tokens)."""

    parallel: int
    ctx: int

    @property
    def total_ctx(self) -> int:
        return self.parallel * self.ctx


def with_cache(shape: ModelShape, cache: str) -> ModelShape:
    """``shape`` with its KV cache stored as ``cache`` (f16, q8_0, q4_0) instead of f16."""
    per_block, elems = CACHE_TYPES[cache]
    n = shape.kv_bytes_per_token_layer // 2  # f16: two bytes an element
    return replace(shape, kv_bytes_per_token_layer=-(-n * per_block // elems))


def _scaled(s: Slot, share: float) -> Slot:
    return replace(s, capacity=int(s.capacity * share), shares=tuple(int(x * share) for x in s.shares))


def size(
    shape: ModelShape,
    host: Slot,
    others: list[Slot],
    parallel: int | None,
    ctx: int | None,
    cache: str = "f16",
    max_rtt_ms: float = MAX_RTT_MS,
    split: list[float] | None = None,
    prefer: set[NodeId] | None = None,
    busy: Set[NodeId] = frozenset(),
) -> tuple[Plan | Waiting, Sizing]:
    """The plan and the slots it runs. ``parallel`` / ``ctx`` None ("auto"): the most slots (up to MAX_AUTO_SLOTS),
    then the longest context per slot (up to the model's trained context), that fit AUTO_SHARE of the nodes the model
    needs anyway (its placement with one slot of BASE_CTX): auto sizes never draw another node in. Each slot's KV
    cache is charged to the nodes that hold its layers (``plan``). An explicit size that does not fit is a Waiting
    that says what would."""
    sh = with_cache(shape, cache)
    train = shape.n_ctx_train or BASE_CTX
    base = ctx or min(train, BASE_CTX)

    def run(n: int, c: int, share: float = 1.0) -> Plan | Waiting:
        hs, os_ = (host, others) if share == 1.0 else (_scaled(host, share), [_scaled(o, share) for o in others])
        return plan(sh, hs, os_, n * c, max_rtt_ms, split, prefer, busy)

    if split is not None:  # the user placed the layers: memory is not checked, so auto stays small
        s = Sizing(parallel or 1, base)
        return run(s.parallel, s.ctx), s
    first = run(parallel or 1, base)
    if isinstance(first, Waiting):
        smallest = run(1, min(base, min(train, BASE_CTX)))
        if (parallel or ctx) and isinstance(smallest, Plan):
            return Waiting(first.need, first.have, why=_does_not_fit(run, parallel, ctx, base, first)), Sizing(
                parallel or 1, base)  # fmt: skip
        return first, Sizing(parallel or 1, base)
    nodes = {a.node for a in first.assignments}

    def fits(n: int, c: int) -> bool:
        p = run(n, c, AUTO_SHARE)
        return isinstance(p, Plan) and {a.node for a in p.assignments} <= nodes

    n = parallel or max((k for k in range(1, MAX_AUTO_SLOTS + 1) if fits(k, base)), default=1)
    c = base
    if ctx is None and train > base:
        lo, hi = base // CTX_STEP, train // CTX_STEP  # in steps; lo fits (or is the floor), find the largest that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(n, mid * CTX_STEP) else (lo, mid - 1)
        c = max(base, lo * CTX_STEP)
    s = Sizing(n, c)
    return (first if s == Sizing(parallel or 1, base) else run(n, c)), s


def _does_not_fit(run: Callable[[int, int], Plan | Waiting], parallel: int | None, ctx: int | None, base: int,
                  w: Waiting) -> str:  # fmt: skip
    """The one line for an explicit --parallel / --ctx-size the mesh cannot hold, with the most it can: more slots of
    this context, else one slot of the longest context that fits."""
    asked = f"--parallel {parallel or 1} with --ctx-size {base}"
    n = parallel or 1
    if n > 1 and isinstance(run(1, base), Plan):
        k = max(i for i in range(1, n) if isinstance(run(i, base), Plan))
        fits = f"--parallel {k} fits"
    else:
        lo, hi = 1, base // CTX_STEP  # in steps: the caller knows one slot of min(base, BASE_CTX) fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if isinstance(run(1, mid * CTX_STEP), Plan) else (lo, mid - 1)
        fits = f"--parallel 1 with --ctx-size {lo * CTX_STEP} fits"
    return f"{asked} needs {w.need / GB:.1f} GB, the mesh has {w.have / GB:.1f} GB: {fits} (or add machines)"
