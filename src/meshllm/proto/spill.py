"""Models larger than the mesh's accelerator memory, pure: where the accelerators fall short, the fewest layers' routed
experts go to RAM (the host's own first, then workers'), and past that the host's first layers whole; each node's
parts placed in layer order and its cost kept small (``_spill``), then turned into a plan with each node's
buffers (``_spilling_plan``). ``experts_override`` is llama.cpp's flag that puts a layer's experts in a buffer."""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshllm.proto.layout import (
    Assignment,
    ModelShape,
    Plan,
    Slot,
    host_fixed_bytes,
)


def _by_held(picked: list[Slot]) -> list[Slot]:
    return sorted(picked, key=lambda s: (s.held_from is None, s.held_from or 0, picked.index(s)))


Part = tuple[Slot, int, int, tuple[int, ...], int, int]  # (slot, first layer, count, spilled layers, accelerator, RAM)


@dataclass(frozen=True)
class _Spilled:
    """A placement that uses RAM: each node's ``Part`` (its layers' bytes only, no buffers), workers in
    layer order then the host; the host's layers whole in RAM (the first ``ram_layers``, ``ram_layer_bytes``); and
    its cost, (expert bytes in RAM, of them on workers)."""

    parts: tuple[Part, ...]
    ram_layers: int
    ram_layer_bytes: int
    cost: tuple[int, int]


def _spill(shape: ModelShape, ctx: int, host: Slot, host_budget: int, order: list[Slot], per_device: int
           ) -> _Spilled | None:  # fmt: skip
    """A placement for a mesh whose accelerators are short of the model, or None when its RAM is short too.

    Pooled accelerator memory first: every node takes contiguous layers, each as many as its accelerator holds with
    the routed experts (``ffn_*_exps``) of its first ones in its own RAM (llama.cpp's ``--n-cpu-moe``, as tensor
    overrides: the host's CPU, a worker's rpc-server's CPU device); the fewest expert bytes in RAM, on the host rather
    than on a worker where that is as few (no network round trip between a node's GPU and CPU). Where even every
    expert in RAM leaves the accelerators short (a dense model: always), the first layers go whole into the host's
    RAM (llama.cpp's ``--n-gpu-layers``): the fewest such layers. A node that uses its RAM holds a compute buffer
    there too."""
    n = shape.n_layer
    cost, exps = _sums(shape, ctx)
    chain_vram = host_budget + sum(max(0, s.capacity - s.devices * per_device) for s in order)
    host_ram = host.ram - per_device
    c = 0  # layers whole in the host's RAM: no fewer than leave the accelerators enough with every expert in RAM
    while c < n and (cost[n] - cost[c]) - (exps[n] - exps[c]) > chain_vram:
        c += 1
    while c <= n and cost[c] <= host_ram:
        got = _spill_from(c, cost, exps, host, host_budget, host_ram - cost[c], order, per_device)
        if got is not None:
            return _Spilled(got[0], c, cost[c], got[1])
        c += 1
    return None


def _spill_from(start: int, cost: list[int], exps: list[int], host: Slot, host_budget: int, host_ram: int,
                order: list[Slot], per_device: int) -> tuple[tuple[Part, ...], tuple[int, int]] | None:  # fmt: skip
    """Layers [start, n) over the workers in ``order`` and the host (last), with the fewest expert bytes in RAM (a
    dynamic programme over (worker, first layer)), and that cost; None when no placement fits."""
    n = len(cost) - 1
    inf = (1 << 62, 0)

    def fits(a: int, b: int, k: int, vram: int) -> bool:  # [a, b) with the first k layers' experts in RAM
        return (cost[b] - cost[a]) - (exps[a + k] - exps[a]) <= vram

    m = len(order)
    best = [[inf] * (n + 1) for _ in range(m + 1)]  # best[j][a]: layers [a, n) by workers j.. and the host
    step = [[(n, 0)] * (n + 1) for _ in range(m + 1)]  # ... its first node's (end, layers spilled)
    for a in range(start, n + 1):  # the host: layers [a, n), the fewest of their experts in RAM
        k = next((k for k in range(n - a + 1) if fits(a, n, k, host_budget)), None)
        if k is not None and exps[a + k] - exps[a] <= host_ram:
            best[m][a], step[m][a] = (exps[a + k] - exps[a], 0), (n, k)
    for j in range(m - 1, -1, -1):  # worker j: layers [a, b), the rest by workers j + 1.. and the host
        vram, ram = order[j].capacity - order[j].devices * per_device, max(0, order[j].ram - per_device)
        for a in range(start, n + 1):
            best[j][a], step[j][a] = best[j + 1][a], (a, 0)  # it takes none
            k = 0
            for b in range(a + 1, n + 1):
                while k < b - a and not fits(a, b, k, vram):
                    k += 1
                spill = exps[a + k] - exps[a]
                if not fits(a, b, k, vram) or spill > ram:
                    break  # more layers need only more
                rest = best[j + 1][b]
                if rest != inf and (rest[0] + spill, rest[1] + spill) <= best[j][a]:  # a tie: this worker takes more
                    best[j][a], step[j][a] = (rest[0] + spill, rest[1] + spill), (b, k)
    if best[0][start] == inf:
        return None
    parts: list[Part] = []
    a = start
    for j, s in enumerate([*order, host]):
        b, k = step[j][a]
        if b > a or s is host:
            ram_b = exps[a + k] - exps[a]
            parts.append((s, a, b - a, tuple(range(a, a + k)), cost[b] - cost[a] - ram_b, ram_b))
        a = b
    return tuple(parts), best[0][start]


def _spilling_plan(shape: ModelShape, ctx: int, host: Slot, others: list[Slot], host_budget: int, order: list[Slot],
                   per_device: int) -> Plan | None:  # fmt: skip
    """``_spill``'s placement as a plan (each node's buffers added), its workers in the order of the layers they
    hold where that costs no more RAM (as a plan without RAM does)."""
    got = _spill(shape, ctx, host, host_budget, order, per_device)
    if got is None:
        return None
    picked = [p[0] for p in got.parts[:-1]]
    if (by_held := _by_held(picked)) != picked:
        again = _spill_from(got.ram_layers, *_sums(shape, ctx), host, host_budget,
                            host.ram - per_device - got.ram_layer_bytes, by_held, per_device)  # fmt: skip
        if again is not None and again[1] <= got.cost:
            got = replace(got, parts=again[0], cost=again[1])
    assignments = []
    for s, first, count, spilled, vram, ram in got.parts:
        if s is host:
            b = vram + host_fixed_bytes(shape, ctx, host.gpu) + (s.devices - 1) * per_device
            ram += got.ram_layer_bytes
        else:
            b = vram + s.devices * per_device
        assignments.append(Assignment(s.node, first, count, b, s.shares, spilled, ram, cpu_last=s.cpu_last))
    used = {a.node for a in assignments}
    standby = tuple(sorted(s.node for s in others if s.node not in used))
    return Plan(host.node, tuple(assignments), standby, ram_layers=got.ram_layers)


def _sums(shape: ModelShape, ctx: int) -> tuple[list[int], list[int]]:
    cost, exps = [0], [0]
    for i in range(shape.n_layer):
        cost.append(cost[-1] + shape.layer_cost(i, ctx))
        exps.append(exps[-1] + shape.experts(i))
    return cost, exps


def experts_override(layers: tuple[int, ...], buffer: str = "CPU") -> str:
    """llama.cpp's ``--override-tensor`` value that puts the routed experts of ``layers`` in ``buffer``."""
    return rf"blk\.({'|'.join(map(str, layers))})\.ffn_(up|down|gate)_exps={buffer}"
