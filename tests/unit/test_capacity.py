"""What a node offers: the free memory of the accelerator llama.cpp sees, less a margin; RAM on a CPU node;
--max-vram caps both."""

from __future__ import annotations

from meshllm.proto.capacity import MARGIN_MIN, Device, MiB, offer, parse_devices
from meshllm.proto.layout import GB

# the format of llama.cpp's common_print_available_devices (b11312)
TWO_GPUS = """Available devices:
  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80519 MiB free)
  CUDA1: NVIDIA H100 80GB HBM3 (81079 MiB, 60000 MiB free)
"""
CPU_ONLY = "Available devices:\n  (none)\n"


def test_listing_is_parsed_for_any_backend() -> None:
    devs = parse_devices(TWO_GPUS)
    assert devs == [
        Device("CUDA0", "NVIDIA H100 80GB HBM3", 81079 * MiB, 80519 * MiB),
        Device("CUDA1", "NVIDIA H100 80GB HBM3", 81079 * MiB, 60000 * MiB),
    ]
    assert parse_devices(CPU_ONLY) == [] and parse_devices("") == []
    others = parse_devices(
        "  MTL0: Apple M2 Max (49152 MiB, 49152 MiB free)\n  Vulkan0: AMD Radeon (x) (8176 MiB, 8000 MiB free)"
    )
    assert [(d.kind, d.description) for d in others] == [("metal", "Apple M2 Max"), ("vulkan", "AMD Radeon (x)")]
    assert parse_devices("  ROCm0: AMD Instinct MI300X (196592 MiB, 196000 MiB free)")[0].kind == "rocm"


def test_a_gpu_node_offers_its_gpus_not_its_ram() -> None:
    o = offer(parse_devices(TWO_GPUS), ram_total=256 * GB, max_gb=None)
    margin = max(int(81079 * MiB * 0.05), MARGIN_MIN)
    assert o.shares == (80519 * MiB - margin, 60000 * MiB - margin)  # every GPU, each less its margin
    assert o.capacity == sum(o.shares)  # about 140 GB, not 192 GB of RAM
    assert o.device == "cuda: 2× NVIDIA H100 80GB HBM3" and o.use == "CUDA0,CUDA1" and o.first_device == "CUDA0"
    one = offer(parse_devices(TWO_GPUS)[:1], ram_total=256 * GB, max_gb=None)
    assert one.shares == () and one.use == "CUDA0" and one.device == "cuda: NVIDIA H100 80GB HBM3"


def test_a_cpu_node_offers_three_quarters_of_its_ram() -> None:
    o = offer([], ram_total=24 * GB, max_gb=None)
    assert (o.capacity, o.device, o.use) == (18 * GB, "cpu", None)


def test_max_vram_caps_both() -> None:
    capped = offer(parse_devices(TWO_GPUS), 256 * GB, max_gb=3.5)
    assert capped.capacity == int(3.5 * GB) == sum(capped.shares)
    assert capped.shares[0] > capped.shares[1] > 0  # each GPU's part shrinks in proportion
    assert offer([], 24 * GB, max_gb=0.3).capacity == int(0.3 * GB)
    assert offer([], 24 * GB, max_gb=100).capacity == 18 * GB  # a cap above what there is changes nothing


def test_a_nearly_full_gpu_offers_nothing_rather_than_less_than_zero() -> None:
    full = [Device("CUDA0", "busy", 8192 * MiB, 100 * MiB)]
    assert offer(full, 64 * GB, None).capacity == 0


def test_llama_threads_follow_the_cpus_this_process_may_use() -> None:
    """A node pinned to one CPU (taskset, a cpuset) runs llama.cpp with one thread, not one per CPU of the
    machine (two threads on one CPU wait for each other)."""
    import os
    import subprocess
    import sys

    code = "from meshllm.llama.supervisor import default_threads; print(default_threads())"
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)  # fmt: skip
    free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(pinned.stdout) == 1
    assert int(free.stdout) == len(os.sched_getaffinity(0))


def test_a_node_offers_ram_beside_its_accelerator_for_routed_experts() -> None:
    """A GPU node offers three quarters of its RAM besides its VRAM (--max-ram caps it); a CPU node's RAM is
    its capacity, capped by --max-vram: RAM beside that only as much as --max-ram says (so a capped CPU node in a
    test or on a shared machine keeps to its cap), within what the capacity leaves."""
    gpu = offer(parse_devices(TWO_GPUS), 256 * GB, max_gb=None)
    assert gpu.ram == 192 * GB
    assert offer(parse_devices(TWO_GPUS), 256 * GB, None, max_ram_gb=10).ram == 10 * GB
    assert offer(parse_devices(TWO_GPUS), 256 * GB, None, max_ram_gb=0).ram == 0  # --max-ram 0: no RAM at all
    assert offer([], 24 * GB, None).ram == 0  # a CPU node's capacity is its RAM already
    capped = offer([], 24 * GB, max_gb=2, max_ram_gb=None)
    assert (capped.capacity, capped.ram) == (2 * GB, 0)
    assert offer([], 24 * GB, max_gb=2, max_ram_gb=0.5).ram == int(0.5 * GB)
    assert offer([], 24 * GB, max_gb=2, max_ram_gb=100).ram == 16 * GB  # what the 3/4 share leaves
