"""``mesh-llm doctor`` — what this machine has for a node, one line per check and, where one fails,
its fix: Python, the build tools, llama.cpp's build, the GPU and its toolkit, the API port, the state dir, disk for
models, and — where a node runs on the state dir — which members it reaches and how (direct UDP or a relay)."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import MeshError
from meshllm.machine.state import running_pid

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    result: str  # OK, WARN or FAIL
    what: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.result:<4}  {self.what}" + (f" — {self.fix}" if self.fix else "")


def python() -> Check:
    v = sys.version_info
    text = f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})"
    if v < (3, 11):
        return Check(FAIL, text, "mesh-llm needs 3.11 or later: scripts/setup installs the distribution's python3.11")
    return Check(OK, text)


def build_tools() -> Check:
    missing = [name for name, cmds in (("cmake", ("cmake",)), ("a C++ compiler", ("c++", "g++", "clang++")),
                                       ("git", ("git",))) if not any(shutil.which(c) for c in cmds)]  # fmt: skip
    if missing:
        return Check(WARN, f"build tools: no {', '.join(missing)}",
                     "apt-get install cmake g++ git (once, to build llama.cpp; a bundle needs none)")  # fmt: skip
    return Check(OK, "build tools: cmake, a C++ compiler, git")


def llama_build() -> Check:
    from meshllm.llama import build as b

    try:
        bins = b.find_binaries()
    except MeshError as e:
        return Check(WARN, f"llama.cpp: {e}", "mesh-llm build (about 10 minutes on 2 cores; the first start does it)")
    return Check(OK, f"llama.cpp: {bins.describe()}")


def gpu() -> Check:
    from meshllm.llama import hardware as b

    if not b.gpu_visible():
        return Check(OK, "GPU: none visible (nvidia-smi, /dev/nvidia*): the node runs on the CPU and RAM")
    nvcc = b.find_nvcc()
    if nvcc is None:
        return Check(FAIL, "GPU: visible, but no CUDA toolkit (nvcc) on PATH, in $CUDA_HOME or /usr/local/cuda*",
                     "apt-get install nvidia-cuda-toolkit (or NVIDIA's cuda-toolkit), then mesh-llm build")  # fmt: skip
    return Check(OK, f"GPU: visible; CUDA toolkit {nvcc}")


def api_port(port: int, state: Path) -> Check:
    from meshllm.llama.processes import port_in_use

    if not port_in_use(port):
        return Check(OK, f"API port {port}: free")
    if _status(state).get("api_port") == port or running_pid(state) is not None:
        return Check(OK, f"API port {port}: the node on {state} listens there")
    return Check(FAIL, f"API port {port}: in use by another program", "stop it, or give the node --port N")


def state_ok(state: Path) -> Check:
    from meshllm.machine.state import check_dir

    try:
        check_dir(state)
    except MeshError as e:
        return Check(FAIL, f"state dir {state}: {e}", "give the node --state-dir DIR of your own (mode 0700)")
    pid = running_pid(state)
    return Check(OK, f"state dir {state}" + (f": a node runs on it (pid {pid})" if pid else ""))


def disk(where: Path, need: int | None) -> Check:
    probe = where if where.exists() else next((p for p in where.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    text = f"disk for models ({where}): {free / 1e9:.1f} GB free"
    if need is not None and free < need:
        return Check(FAIL, f"{text}, the model needs {need / 1e9:.1f} GB", "free some, or --models-dir DIR elsewhere")
    if free < 2e9:
        return Check(WARN, text, "most models need more: --models-dir DIR elsewhere")
    return Check(OK, text)


def reach(state: Path) -> Check:
    """The members the node on ``state`` reaches, and how (its last status.json)."""
    if running_pid(state) is None:
        return Check(OK, "members reached: no node runs on this state dir (start one, then run doctor again)")
    d = _status(state)
    me, peers = d.get("node"), d.get("peers")
    others = [p for p in peers if isinstance(p, dict) and p.get("node") != me] if isinstance(peers, list) else []
    if not others:
        return Check(WARN, "members reached: none yet", "a node alone has nobody to reach; check the token's "
                     "addresses (`mesh-llm token`) and that UDP is open between the machines")  # fmt: skip
    paths = [str(p.get("path", "?")) for p in others]
    direct = sum(1 for x in paths if x.startswith("direct"))
    relayed = sum(1 for x in paths if x.startswith("relay"))
    lost = len(paths) - direct - relayed
    text = f"members reached: {direct} of {len(paths)} directly over UDP, {relayed} through a relay"
    if lost:
        return Check(WARN, f"{text}, {lost} not connected", "UDP between the machines may be blocked: open the mesh "
                     "port (--bind-port) or let a publicly reachable member relay")  # fmt: skip
    return Check(OK, text)


def _status(state: Path) -> dict[str, object]:
    try:
        d: dict[str, object] = json.loads((state / "status.json").read_text())
        return d
    except (OSError, ValueError):
        return {}


def checks(state: Path, port: int, where: Path, need: int | None) -> list[Check]:
    return [python(), build_tools(), llama_build(), gpu(), state_ok(state), api_port(port, state), disk(where, need),
            reach(state)]  # fmt: skip
