"""What produced a benchmark's table ([house-2] 5): the command line and the machine, printed above it, so a number
quoted from it carries both. Every benchmark's ``main`` calls ``header()`` once its arguments parse."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path


def machine() -> str:
    """CPU model and the cores this process may use, RAM, GPUs (nvidia-smi's names), OS, Python, the time (UTC)."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "?")  # fmt: skip
    mem_kb = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                   if line.startswith("MemTotal:")), 0)  # fmt: skip
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = ""
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        names = [n.strip() for n in r.stdout.splitlines() if n.strip()]
        if names:
            gpus = f"; {len(names)}× {names[0]}" if len(set(names)) == 1 else f"; {', '.join(names)}"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f"{cpu}, {cores} cores, {mem_kb / 2**20:.0f} GiB RAM{gpus}; {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; {when}")  # fmt: skip


def header() -> None:
    print("$ " + shlex.join([Path(sys.executable).name, *sys.argv]), flush=True)
    print("# machine: " + machine(), flush=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
