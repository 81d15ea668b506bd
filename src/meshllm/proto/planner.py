"""The split plan: which node runs which layers. A pure function of (model shape x nodes).

llama.cpp gives each device a contiguous range of layers in device order, and the output layer to the last
device. The host lists the workers first and its own device last, so workers get the first layers and the host
the last ones plus the output: logits never cross the network. The token embedding stays in the host's RAM, or,
where the first worker has room for it beside its layers, goes there (``Plan.embd_first``, patch 0013): that worker
looks tokens up, so a batch sends it token ids instead of embedding rows. The layout is the same either way.

Use as few nodes as the model needs: the host first (it has the most capacity), then the others by RTT to the
host (lowest first), skipping nodes beyond MAX_RTT_MS while nearer ones suffice. The rest stand by.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import replace

from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import (
    GB,
    Assignment,
    ModelShape,
    Plan,
    Slot,
    Waiting,
    host_fixed_bytes,
)
from meshllm.proto.record import PeerRecord, Role
from meshllm.proto.spill import _by_held, _spilling_plan
from meshllm.proto.token import Scope

MAX_RTT_MS = 80.0
RTT_BUCKET_MS = 25.0


def plan(
    shape: ModelShape,
    host: Slot,
    others: list[Slot],
    ctx: int,
    max_rtt_ms: float = MAX_RTT_MS,
    split: list[float] | None = None,
    prefer: set[NodeId] | None = None,
    busy: Set[NodeId] = frozenset(),
) -> Plan | Waiting:
    """Assign every layer, or say how much memory is missing. ``split`` (--tensor-split) overrides the sizes.
    ``busy``: nodes that serve a replica of the model (``fleet.replica_nodes``), taken only after the idle ones."""
    n = shape.n_layer
    keep = prefer or set()

    def near_order(s: Slot) -> tuple[bool, bool, int, bytes]:
        # the nodes already in the plan first (a change costs a model reload), then idle before busy (taking a
        # replica's node ends what it serves), then capacity, then id. RTT only decides near or far: RTTs jitter,
        # and every node must compute the same plan from the same table
        return (s.node not in keep, s.node in busy, -s.capacity, s.node)

    def far_order(s: Slot) -> tuple[bool, bool, int, int, bytes]:
        return (s.node not in keep, s.node in busy, int(s.rtt_ms // RTT_BUCKET_MS), -s.capacity, s.node)

    if host.gpu and split is None and any(not s.gpu for s in others):
        # accelerators first, with their nodes' RAM where short; nodes without one only where even that is
        # (their capacity is RAM: layers whole on a CPU beside a GPU host keep less of the work on accelerators)
        with_gpus = plan(shape, host, [s for s in others if s.gpu], ctx, max_rtt_ms, None, prefer, busy)
        if isinstance(with_gpus, Plan):
            cpus = tuple(s.node for s in others if not s.gpu)
            return replace(with_gpus, standby=tuple(sorted(with_gpus.standby + cpus)))
    near = sorted((s for s in others if s.rtt_ms <= max_rtt_ms), key=near_order)
    far = sorted((s for s in others if s.rtt_ms > max_rtt_ms), key=far_order)
    if split is not None:
        return _plan_override(shape, host, near + far, ctx, split)
    per_device = shape.compute_bytes(ctx, output=False)  # every device of a node holds its own compute buffer
    host_budget = host.capacity - host_fixed_bytes(shape, ctx, host.gpu) - (host.devices - 1) * per_device
    # the host takes the last layers, as many as fit
    host_count = 0
    used = 0
    while host_count < n and used + shape.layer_cost(n - 1 - host_count, ctx) <= host_budget:
        used += shape.layer_cost(n - 1 - host_count, ctx)
        host_count += 1
    remaining = n - host_count  # layers [0, remaining) go to workers

    chosen, reached = _fill(shape, ctx, near + far, remaining, per_device)
    if reached < remaining:  # short of accelerator memory: RAM, as little of it as the model needs
        got = _spilling_plan(shape, ctx, host, others, host_budget, near + far, per_device)
        if got is None:
            need = host_fixed_bytes(shape, ctx, host.gpu) + sum(shape.layer_cost(i, ctx) for i in range(n))
            need += sum(s.devices for s in others) * per_device + (host.devices - 1) * per_device
            return Waiting(need=need, have=host.capacity + sum(s.capacity for s in others)
                           + host.ram + sum(s.ram for s in others))  # fmt: skip
        return _within_cap(host, got)
    # the same workers, in the order of the layers they already hold (those holding none after, as they were): a
    # re-plan moves no layer a worker holds to another where the same workers can keep them
    picked = [s for s, _, _ in chosen]
    by_held = _by_held(picked)
    if by_held != picked and (again := _fill(shape, ctx, by_held, remaining, per_device))[1] >= remaining:
        chosen = again[0]
    # workers in layer order, then the host
    assignments: list[Assignment] = []
    first = 0
    for s, count, b in chosen:
        assignments.append(Assignment(s.node, first, count, b, s.shares, cpu_last=s.cpu_last))
        first += count
    host_bytes = used + host_fixed_bytes(shape, ctx, host.gpu) + (host.devices - 1) * per_device
    assignments.append(Assignment(host.node, first, host_count, host_bytes, host.shares))
    used_nodes = {a.node for a in assignments}
    standby = tuple(sorted(s.node for s in others if s.node not in used_nodes))
    return _within_cap(host, _embd_first(shape, Plan(host=host.node, assignments=tuple(assignments), standby=standby),
                                         others))  # fmt: skip


def _fill(shape: ModelShape, ctx: int, order: list[Slot], end: int, per_device: int
          ) -> tuple[list[tuple[Slot, int, int]], int]:  # fmt: skip
    """Layers [0, ``end``) to the slots in ``order``, each as many whole as its memory holds: (slot, count, bytes)
    of those that take any, and the first layer none took (``end`` when they hold them all)."""
    out: list[tuple[Slot, int, int]] = []
    layer = 0
    for s in order:
        if layer >= end:
            break
        budget = s.capacity - s.devices * per_device
        count, b = 0, 0
        while layer + count < end and b + shape.layer_cost(layer + count, ctx) <= budget:
            b += shape.layer_cost(layer + count, ctx)
            count += 1
        if count:
            out.append((s, count, b + s.devices * per_device))
            layer += count
    return out, layer


def _within_cap(host: Slot, p: Plan) -> Plan | Waiting:
    """Caps are caps. The host always holds the output layer and its buffers (the embedding too, unless
    the first worker takes it): where even that exceeds what it offers, the mesh waits and says so (a node capped at
    0.4 GB once hosted with 0.45 GB planned)."""
    mine = p.assignments[-1]
    if mine.bytes <= host.capacity:
        return p
    return Waiting(need=mine.bytes, have=host.capacity,
                   why=f"the host's {host.capacity / GB:.2f} GB is less than the output layer, embeddings and "
                       f"buffers it must hold ({mine.bytes / GB:.2f} GB): give it more (--max-vram) or a smaller "
                       f"--ctx-size")  # fmt: skip


def _embd_first(shape: ModelShape, p: Plan, slots: list[Slot]) -> Plan:
    """``p`` with the token embedding on its first worker when that has room for it beyond what the plan gives it
    and is trusted with prompts (``Slot.prompts``: it receives the token ids); the host keeps its room for it: it
    holds the embedding when it runs alone, and when no worker may or can."""
    if len(p.assignments) < 2:
        return p
    first = p.assignments[0]
    slot = next(s for s in slots if s.node == first.node)
    if first.count == 0 or not slot.prompts or slot.capacity - first.bytes < shape.embd_bytes:
        return p
    *middle, host = p.assignments[1:]
    moved = (
        replace(first, bytes=first.bytes + shape.embd_bytes),
        *middle,
        replace(host, bytes=host.bytes - shape.embd_bytes),
    )
    return replace(p, assignments=moved, embd_first=True)


def _plan_override(shape: ModelShape, host: Slot, ordered: list[Slot], ctx: int, split: list[float]) -> Plan | Waiting:
    """--tensor-split: proportions for the workers in RTT order, then the host (llama.cpp device order); Waiting
    while the mesh has fewer nodes than the split names."""
    n = shape.n_layer
    k = len(split)
    if k < 1 or any(x < 0 for x in split) or sum(split) <= 0:
        raise ValueError("--tensor-split needs non-negative proportions with a positive sum")
    nodes = ordered[: k - 1]
    if len(nodes) < k - 1:
        return Waiting(0, 0, why=f"--tensor-split names {k} devices, the mesh has {len(ordered) + 1} nodes")
    counts = [int(n * x / sum(split)) for x in split]
    counts[-1] += n - sum(counts)
    assignments: list[Assignment] = []
    first = 0
    for s, c in zip([*nodes, host], counts, strict=True):
        b = sum(shape.layer_cost(i, ctx) for i in range(first, first + c))
        b += host_fixed_bytes(shape, ctx, host.gpu) if s is host else shape.compute_bytes(ctx, output=False)
        assignments.append(Assignment(s.node, first, c, b, s.shares, cpu_last=s.cpu_last))
        first += c
    used = {a.node for a in assignments}
    p = Plan(host.node, tuple(assignments), tuple(sorted(s.node for s in ordered if s.node not in used)))
    return _embd_first(shape, p, nodes)


def plan_broken(current: Plan | Waiting | None, alive: set[NodeId]) -> bool:
    """The plan names a node that is gone: it cannot run, so its replacement need not wait out the debounce."""
    return isinstance(current, Plan) and any(a.node not in alive for a in current.assignments)


def adopt_at_once(current: Plan | Waiting | None, proposed: Plan | Waiting, alive: set[NodeId],
                  host_runs: tuple[NodeId, ...] | None) -> bool:  # fmt: skip
    """Whether ``proposed`` replaces ``current`` without the debounce: ``current`` names a node that is gone; the
    elected host (another node) already runs ``proposed`` — its record names the same nodes (``host_runs``; None on
    the host itself), it waited out its own debounce and its llama-server waits for our key; or ``current`` waited
    for memory and ``proposed`` can run — nothing serves that a later change would cost a reload."""
    names = tuple(a.node for a in proposed.assignments) if isinstance(proposed, Plan) else None
    return (plan_broken(current, alive) or (names is not None and host_runs == names)
            or (isinstance(current, Waiting) and names is not None))  # fmt: skip


def slots_for(records: list[PeerRecord], host: NodeId, fingerprint: str) -> tuple[Slot, list[Slot]] | None:
    """The planner's input from live gossip records: the host's slot and every other node holding the same model
    (lite clients and client-scoped members excluded), each with its RTT as the host measured it. None while the
    host's record is missing."""
    recs = [r for r in records if r.model and r.model.fingerprint == fingerprint and r.role != Role.CLIENT
            and r.scope >= Scope.WORKER]  # fmt: skip
    host_rec = next((r for r in recs if r.node == host), None)
    if host_rec is None:
        return None
    rtt = host_rec.rtt_ms
    others = [Slot(r.node, r.capacity, rtt.get(r.node, 0.0), shares=r.shares, prompts=r.scope >= Scope.HOST, ram=r.ram,
                   gpu=r.device != "cpu",
                   held_from=min((f for f, c in r.held if c > 0), default=None) if r.held else None)
              for r in recs if r.node != host]  # fmt: skip
    me = Slot(host, host_rec.capacity, shares=host_rec.shares, ram=host_rec.ram, gpu=host_rec.device != "cpu")
    return me, others
