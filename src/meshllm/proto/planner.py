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

from collections.abc import Callable, Set
from dataclasses import dataclass, replace

from meshllm.proto.crypto import NodeId
from meshllm.proto.gossip import PeerRecord, Role
from meshllm.proto.token import Scope

MAX_RTT_MS = 80.0
RTT_BUCKET_MS = 25.0
MiB = 1 << 20
GB = 1_000_000_000
COMPUTE_BASE = 22 * MiB  # per device: graph and scratch buffers beyond what scales (calibrated: see the split test)
# the host's compute and output buffers per token of the vocabulary (calibrated: CUDA, the 8B and 30B-A3B shapes on an
# H200, README "Mixtures of experts"; CPU, the tiny model's split, tests/integration/test_moe.py -k allocation)
OUTPUT_GPU = 256
OUTPUT_CPU = 64


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    layer_bytes: tuple[int, ...]  # weights of each repeating layer
    embd_bytes: int  # token embedding: host RAM (or the first worker's: Plan.embd_first)
    output_bytes: int  # output matrix (a copy of the embedding when tied): host device
    other_bytes: int  # norms and the like: host
    kv_bytes_per_token_layer: int  # K + V cache, one token, one layer (f16)
    n_embd: int
    n_vocab: int
    n_ctx_train: int = 0  # the context the model was trained for (0: not known)
    expert_bytes: tuple[int, ...] = ()  # each layer's routed experts (ffn_*_exps), part of layer_bytes; () none

    def experts(self, i: int) -> int:
        return self.expert_bytes[i] if i < len(self.expert_bytes) else 0

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embd_bytes + self.output_bytes + self.other_bytes

    def layer_cost(self, i: int, ctx: int) -> int:
        return self.layer_bytes[i] + self.kv_bytes_per_token_layer * ctx

    def compute_bytes(self, ctx: int, output: bool, ubatch: int = 512, gpu: bool = False) -> int:
        """A device's compute buffers; ``output``: the host's, which also computes the logits (``gpu``: on an
        accelerator, whose graph keeps more of them live than ggml's CPU backend does)."""
        act = 4 * ubatch * self.n_embd * 4  # a few live f32 activations of the micro-batch
        logits = (OUTPUT_GPU if gpu else OUTPUT_CPU) * self.n_vocab if output else 0
        return COMPUTE_BASE + act + logits + ctx * 256


@dataclass(frozen=True)
class Slot:
    node: NodeId
    capacity: int  # bytes
    rtt_ms: float = 0.0  # to the host
    name: str = ""
    shares: tuple[int, ...] = ()  # a node with several devices: each one's part of ``capacity``, in device order
    # trusted with the prompts in clear: host-scoped, as the mesh trusts any node it may elect host.
    # Only such a first worker takes the token embedding (it then receives token ids, not embedding rows)
    prompts: bool = False
    # a partial copy's first layer held (None for a whole file or nothing held): workers that hold layers
    # keep them across re-plans (equal workers once swapped ranges 3-5 times and each fetched both)
    held_from: int | None = None
    ram: int = 0  # bytes of RAM offered beside ``capacity`` (``--max-ram``): routed experts, whole layers
    gpu: bool = False  # ``capacity`` is an accelerator's: its RAM is another device (see ``cpu_last``)

    @property
    def devices(self) -> int:
        return max(1, len(self.shares))

    @property
    def cpu_last(self) -> bool:
        """Its rpc-server serves its CPU as one more device, after its accelerators (``serves_cpu``)."""
        return serves_cpu(self.gpu, self.ram)


def serves_cpu(gpu: bool, ram: int) -> bool:
    """A node with an accelerator that offers RAM serves its CPU too, as the last device of its rpc-server,
    so a host may put that node's routed experts in its RAM (``RPC<n>[endpoint]`` buffers)."""
    return gpu and ram > 0


@dataclass(frozen=True)
class Assignment:
    node: NodeId
    first: int  # first layer
    count: int  # number of layers
    bytes: int  # estimated memory on that node (its accelerator's; the whole of it on a CPU node)
    shares: tuple[int, ...] = ()  # the node's devices (see Slot.shares): its layers spread over them in proportion
    spilled: tuple[int, ...] = ()  # its layers whose routed experts live in its RAM, not in ``bytes``
    ram_bytes: int = 0  # those experts' bytes (the host's: and its whole layers in RAM, ``Plan.ram_layers``)
    cpu_last: bool = False  # the node's rpc-server serves its CPU as its last device (``Slot.cpu_last``)


@dataclass(frozen=True)
class Plan:
    host: NodeId
    assignments: tuple[Assignment, ...]  # llama.cpp device order: workers, then the host last
    standby: tuple[NodeId, ...]
    embd_first: bool = False  # the token embedding on the first worker (counted in its bytes), not the host
    ram_layers: int = 0  # layers [0, ram_layers) whole in the host's RAM (llama.cpp's --n-gpu-layers)

    @property
    def n_gpu_layers(self) -> int | None:
        """llama-server's --n-gpu-layers: the units the devices hold (None: all of them, the default)."""
        return sum(self.tensor_split) if self.ram_layers else None

    @property
    def workers(self) -> tuple[Assignment, ...]:
        return tuple(a for a in self.assignments if a.node != self.host)

    @property
    def tensor_split(self) -> tuple[int, ...]:
        """llama.cpp's --tensor-split for this plan, one entry per device in device order (workers, host last).

        llama.cpp spreads n_layer + 1 units over the devices — the output layer is the last unit — and puts unit i
        on the first device whose cumulative share exceeds i / (n_layer + 1). So the host's entry is its layer count
        plus one: then every layer lands where the plan says, and the output (and the logits) stay on the host
        even when it holds no repeating layer. (Plain layer counts gave a worker the output when the host held
        none, and shifted a layer onto the workers otherwise.) A node with several devices has an entry for each:
        its layers spread over them in proportion to their memory, the host's output on its last one. A node whose
        rpc-server serves its CPU too has an entry 0 for it (the host places only tensors there, by overrides).
        Layers whole in the host's RAM (``ram_layers``) are not units of the split: llama.cpp keeps them on its CPU
        ahead of every device, and spreads the offloaded units only."""
        counts: list[int] = []
        for a in self.assignments:
            counts += spread(a.count, a.shares) + ([0] if a.cpu_last and a.node != self.host else [])
        counts[-1] += 1
        return tuple(counts)


def spread(count: int, shares: tuple[int, ...]) -> list[int]:
    """``count`` layers over devices in proportion to ``shares`` (largest remainders, ties to the earlier device);
    one device when ``shares`` is empty."""
    if len(shares) < 2:
        return [count]
    total = sum(shares)
    if total <= 0:
        return [count] + [0] * (len(shares) - 1)
    parts = [count * s // total for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(count * shares[i] % total), i))
    for i in by_remainder[: count - sum(parts)]:
        parts[i] += 1
    return parts


def device_of_unit(split: tuple[int, ...], unit: int, n_layer: int) -> int:
    """Which device llama.cpp gives unit ``unit`` (a layer index; ``n_layer`` is the output layer) under ``split``
    with every unit offloaded — the rule of its load_tensors (b11312): the first device whose cumulative share of
    the split exceeds unit / (n_layer + 1). For tests of the splits we hand it."""
    total = sum(split)
    cum = 0
    for i, share in enumerate(split):
        cum += share
        if cum * (n_layer + 1) > unit * total:  # cum / total > unit / (n_layer + 1), exactly
            return i
    return len(split) - 1


WAITING = "waiting for more peers"  # how a plan that cannot place the model begins its message (and a host's why)


@dataclass(frozen=True)
class Waiting:
    need: int
    have: int
    why: str = ""  # when memory is not what is missing

    def message(self) -> str:
        if self.why:
            return f"{WAITING} — {self.why}"
        return f"{WAITING} — need {self.need / GB:.1f} GB, have {self.have / GB:.1f} GB"


def host_fixed_bytes(shape: ModelShape, ctx: int, gpu: bool = False) -> int:
    """What the host holds whatever its layers: embedding, output, norms, its compute and output buffers."""
    fixed = shape.embd_bytes + shape.output_bytes + shape.other_bytes
    return fixed + shape.compute_bytes(ctx, output=True, gpu=gpu)


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
