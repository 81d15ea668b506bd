"""Many clients at once on this machine's CPU, tiny model: aggregate generated tokens per wall second and time
to first token, through mesh-llm's API next to llama-server alone with the same slots and context.

    .venv/bin/python benchmarks/concurrency.py [--parallel 4] [--ctx 2048] [--clients 1,4,8] [--tokens 64] [--runs 5]

Rows, all in one run (the cached patched build, ``mesh-llm build``, and the tiny model):
  llama-server alone        --parallel P, every core, asked directly (the best stock configuration for one machine)
  mesh-llm, one node        a solo node with --parallel P, asked at its API (the host's queue, its proxy)
  mesh-llm, via a client    a lite client joined to that node, asked at its API (tunnel over QUIC, the host's door)
Every client streams --tokens greedy tokens after a 32-token prompt of its own; the aggregate is the median of --runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import header  # benchmarks/common.py: the command line and machine
from loadgen import concurrent, ids, one, pct, wait_until

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048, help="context per slot")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    header()
    sys.path.insert(0, str(ROOT / "src"))
    from meshllm.llama.build import find_binaries
    from meshllm.llama.processes import Child, free_port, llama_server_argv, wait_http_ready
    from meshllm.models.tiny import tiny_model_path

    bins, model = find_binaries(), tiny_model_path()
    clients = [int(x) for x in args.clients.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="mesh-conc-"))
    results: list[tuple[str, dict[int, tuple[float, list[float]]]]] = []

    def measure(base: str) -> dict[int, tuple[float, list[float]]]:
        one(base, "/v1/completions", ids(32, 1), 4)  # warm-up
        return {n: concurrent(base, "/v1/completions", n, args.tokens, args.runs, seed=100 * n) for n in clients}

    try:
        port = free_port()
        argv = llama_server_argv(bins, model, port, ctx_size=args.ctx, parallel=args.parallel,
                                 threads=os.cpu_count() or 1)  # fmt: skip
        with Child.start("llama-server", argv, tmp / "alone.log") as c:
            wait_http_ready(c, f"http://127.0.0.1:{port}/health", 120)
            results.append(("llama-server alone", measure(f"http://127.0.0.1:{port}")))
        api, lite_api = free_port(), free_port()
        common = ["--bind-host", "127.0.0.1", "--parallel", str(args.parallel), "--ctx-size", str(args.ctx)]
        host = subprocess.Popen([sys.executable, "-m", "meshllm.cli", "--model", str(model), "--state-dir",
                                 str(tmp / "host"), "--port", str(api), *common],
                                stdout=(tmp / "host.log").open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        lite = None
        try:
            wait_until(lambda: "ready:" in (tmp / "host.log").read_text(errors="replace"), 120, "the node")
            results.append(("mesh-llm, one node", measure(f"http://127.0.0.1:{api}")))
            lite = subprocess.Popen([sys.executable, "-m", "meshllm.cli", "--client", "--join-file",
                                     str(tmp / "host" / "token"), "--state-dir", str(tmp / "lite"), "--port",
                                     str(lite_api), "--bind-host", "127.0.0.1"],
                                    stdout=(tmp / "lite.log").open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
            wait_until(lambda: "API up:" in (tmp / "lite.log").read_text(errors="replace"), 60, "the lite client")
            results.append(("mesh-llm, via a lite client", measure(f"http://127.0.0.1:{lite_api}")))
        finally:
            for p in (lite, host):
                if p is not None:
                    p.terminate()
                    p.wait(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = results[0][1]
    print(f"\n# this machine's CPU ({os.cpu_count()} cores), tiny model, --parallel {args.parallel}, {args.ctx} tokens "
          f"per slot; {args.tokens} greedy tokens per client; aggregate: median of {args.runs} runs")  # fmt: skip
    print("| setup | clients | aggregate tok/s | ÷ llama-server alone | TTFT p50 s | TTFT p95 s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results:
        for n in clients:
            agg, tt = r[n]
            print(f"| {name} | {n} | {agg:.1f} | {agg / base[n][0]:.2f} | {pct(tt, 0.5):.3f} | {pct(tt, 0.95):.3f} |")


if __name__ == "__main__":
    main()
