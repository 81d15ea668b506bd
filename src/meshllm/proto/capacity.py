"""What memory a node offers the mesh, from the devices llama.cpp itself sees (pure: the listing is parsed here,
run elsewhere).

llama.cpp's own device listing (``llama-server --list-devices``) is backend-agnostic — CUDA, ROCm, Metal, Vulkan
devices all appear as ``NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)`` — so a node offers what its accelerators have
free, less a margin for the driver and fragmentation. A node without one offers three quarters of its RAM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshllm.proto.layout import GB, serves_cpu

MiB = 1024 * 1024
RAM_SHARE = 0.75  # a CPU node keeps a quarter of its RAM for the system
MARGIN_SHARE = 0.05  # of an accelerator's total memory, kept free ...
MARGIN_MIN = 512 * MiB  # ... and at least this much

_LINE = re.compile(r"^\s*(?P<name>[A-Za-z][\w.-]*):\s*(?P<desc>.*)\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")


@dataclass(frozen=True)
class Device:
    name: str  # llama.cpp's device name: CUDA0, ROCm0, Vulkan0, MTL0, ...
    description: str  # e.g. NVIDIA H100 80GB HBM3
    total: int  # bytes
    free: int  # bytes

    @property
    def kind(self) -> str:
        """cuda, rocm, vulkan, metal, ...: the name without its index."""
        base = self.name.rstrip("0123456789").lower()
        return {"mtl": "metal"}.get(base, base)


def parse_devices(listing: str) -> list[Device]:
    """The accelerators in ``llama-server --list-devices`` output (none on a CPU-only build)."""
    out = []
    for line in listing.splitlines():
        m = _LINE.match(line)
        if m:
            out.append(Device(m["name"], m["desc"].strip(), int(m["total"]) * MiB, int(m["free"]) * MiB))
    return out


@dataclass(frozen=True)
class Offer:
    capacity: int  # bytes offered to the mesh (all devices together)
    device: str  # what gossip, status and the console show: "cpu", "cuda: NVIDIA H100 80GB HBM3", "cuda: 2× ..."
    use: str | None  # the llama.cpp devices our rpc-server serves, comma-separated (None: its default, the CPU)
    shares: tuple[int, ...] = ()  # per device, in llama.cpp's order, when there are several (they sum to capacity)
    ram: int = 0  # RAM offered beside capacity, for routed experts

    @property
    def first_device(self) -> str | None:
        return first_device(self.use)

    @property
    def served(self) -> str | None:
        """The devices our rpc-server serves: ``use``, and the CPU after them where we offer RAM beside
        accelerators (a host may keep our layers' routed experts there)."""
        return f"{self.use},CPU" if self.use and serves_cpu(True, self.ram) else self.use


def first_device(use: str | None) -> str | None:
    """Where a draft model runs: the first of a node's devices (``use``: llama.cpp's names, comma-separated)."""
    return use.split(",")[0] if use else None


def _label(devices: list[Device]) -> str:
    kinds = sorted({d.kind for d in devices})
    names = sorted({d.description for d in devices})
    count = f"{len(devices)}× " if len(devices) > 1 else ""
    return f"{'/'.join(kinds)}: {count}{' + '.join(names)}"


def offer(devices: list[Device], ram_total: int, max_gb: float | None, max_ram_gb: float | None = None) -> Offer:
    """The memory this node offers. With accelerators: every one's free memory less a margin, all of them served
    (the rpc-server serves each as a device of its own; a host runs them in-process); without: RAM_SHARE of the
    RAM. ``--max-vram`` (``max_gb``) caps the total, each device's share shrinking in proportion. Besides (
    routed experts, whole layers where accelerators are short): a GPU node RAM_SHARE of its RAM, capped by
    ``--max-ram``; a CPU node, whose capacity is its RAM already, only what ``--max-ram`` asks for (of what its
    capacity leaves of RAM_SHARE): a CPU node capped with ``--max-vram`` keeps to that cap."""
    share = int(ram_total * RAM_SHARE)

    def ram(used: int) -> int:
        left = max(0, share - used)
        return min(left, int(max_ram_gb * GB)) if max_ram_gb is not None else left

    if not devices:
        cap = min(share, int(max_gb * GB)) if max_gb is not None else share
        return Offer(cap, "cpu", None, ram=ram(cap) if max_ram_gb is not None else 0)
    shares = [max(0, d.free - max(int(d.total * MARGIN_SHARE), MARGIN_MIN)) for d in devices]
    total = sum(shares)
    if max_gb is not None and total > int(max_gb * GB):
        cap = int(max_gb * GB)
        shares = [s * cap // total for s in shares]
        shares[-1] += cap - sum(shares)
    use = ",".join(d.name for d in devices)
    return Offer(sum(shares), _label(devices), use, tuple(shares) if len(devices) > 1 else (), ram(0))
