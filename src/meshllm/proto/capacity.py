"""What memory a node offers the mesh, from the devices llama.cpp itself sees (pure: the listing is parsed here,
run elsewhere).

llama.cpp's own device listing (``llama-server --list-devices``) is backend-agnostic — CUDA, ROCm, Metal, Vulkan
devices all appear as ``NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)`` — so a node offers what its accelerators have
free, less a margin for the driver and fragmentation. A node without one offers three quarters of its RAM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshllm.proto.planner import GB

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
    capacity: int  # bytes offered to the mesh
    device: str  # what gossip, status and the console show: "cpu", or "cuda: NVIDIA H100 80GB HBM3"
    use: str | None  # the llama.cpp device our rpc-server should serve (None: its default)


def offer(devices: list[Device], ram_total: int, max_gb: float | None) -> Offer:
    """The memory this node offers. With accelerators: the first one's free memory less a margin (an rpc-server
    endpoint stands for one device in the plan's tensor split, so a node serves one device for now); without:
    RAM_SHARE of the RAM. ``--max-vram`` (``max_gb``) caps either."""
    if devices:
        d = devices[0]
        cap = max(0, d.free - max(int(d.total * MARGIN_SHARE), MARGIN_MIN))
        more = f" (1 of {len(devices)} used)" if len(devices) > 1 else ""
        label, use = f"{d.kind}: {d.description}{more}", d.name
    else:
        cap, label, use = int(ram_total * RAM_SHARE), "cpu", None
    if max_gb is not None:
        cap = min(cap, int(max_gb * GB))
    return Offer(cap, label, use)
