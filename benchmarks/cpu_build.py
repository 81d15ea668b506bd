"""Solo decode speed of llama.cpp builds made with different CPU flags, on the tiny model.

    .venv/bin/python benchmarks/cpu_build.py [--runs 5] [--tokens 64] [--build LABEL=BIN_DIR ...]

Default builds: the cached patched builds at each CPU level that exists (native: every extension of this CPU but
AMX; portable: x86-64-v3; generic). Each runs as one llama-server on 127.0.0.1 with all cores, ctx 512, greedy,
once with weight repacking (the default) and once with --no-repack; a build that crashes is shown as such. The
number is llama-server's own decode timing (timings.predicted_per_second) of a --tokens completion after one
warm-up; median of --runs runs. Add e.g. ``--build march-native=DIR`` to compare a build made with ggml's
default -march=native (on an AMX CPU it crashes unless --no-repack).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import header  # benchmarks/common.py: the command line and machine

from meshllm.llama import build as b
from meshllm.llama import hardware as hw
from meshllm.llama.processes import Child, ChildFailed, describe_exit, free_port, llama_server_argv, wait_http_ready
from meshllm.models.tiny import tiny_model_path


def complete(port: int, n: int) -> float:
    body = json.dumps({"prompt": "Once upon a time", "n_predict": n, "temperature": 0, "cache_prompt": False})
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return float(json.loads(r.read())["timings"]["predicted_per_second"])


def measure(bins: b.Binaries, model: Path, repack: bool, runs: int, tokens: int, tmp: Path) -> str:
    port = free_port()
    extra = () if repack else ("--no-repack",)
    argv = llama_server_argv(bins, model, port, ctx_size=512, threads=os.cpu_count() or 1, extra=extra)
    with Child.start("llama-server", argv, tmp / f"llama-{port}.log") as child:
        try:
            wait_http_ready(child, f"http://127.0.0.1:{port}/health", 300)
            complete(port, 8)
            speeds = [complete(port, tokens) for _ in range(runs)]
        except (ChildFailed, OSError):
            if not child.alive():
                return f"crashed ({describe_exit(child.proc.returncode)})"
            raise
    return f"{statistics.median(speeds):.1f}"


def default_builds() -> dict[str, b.Binaries]:
    out = {}
    for level in hw.CPU_LEVELS:
        plan = b.plan_build(cpu_level=level)
        if plan.is_built():
            out[f"{level} ({hw.describe_cpu_flags(plan.cmake_flags)})"] = plan.binaries()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=BIN_DIR")
    args = ap.parse_args()
    header()
    builds = default_builds()
    for spec in args.build:
        label, _, d = spec.partition("=")
        builds[label] = b.user_binaries(Path(d))
    model = tiny_model_path()
    amx = {"amx_tile", "amx_int8"} <= hw.cpu_flags()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, AMX {'yes' if amx else 'no'}; tiny model; tok/s,")
    print(f"# median of {args.runs} runs of {args.tokens} greedy tokens (llama-server's decode timing)")
    print(f"| {'build':<70} | repack (default) | --no-repack |")
    print(f"|{'-' * 72}|-----------------:|------------:|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, bins in builds.items():
            cells = [measure(bins, model, repack, args.runs, args.tokens, Path(tmp)) for repack in (True, False)]
            print(f"| {label:<70} | {cells[0]:>16} | {cells[1]:>11} |", flush=True)


if __name__ == "__main__":
    main()
