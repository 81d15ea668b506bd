"""What a split plan is made of, pure: a model's shape and what its parts cost (``ModelShape``), a node as the
planner sees it (``Slot``), what each node runs (``Assignment``, ``Plan``) or why no plan places the model
(``Waiting``), and the buffers a host needs beyond its layers. The planner (``planner.py``), its RAM placement
(``spill.py``) and the sizing of slots and context (``sizing.py``) build on these."""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.proto.crypto import NodeId

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
