"""tok/s of a 3-node split (host + 2 workers) under added link latency and a rate limit, next to the floor
1 / (t_split + hops × r) and next to stock llama.cpp RPC run the same way.

    .venv/bin/python benchmarks/latency.py [--runs 3] [--tokens 32]

Profiles: r = 0, 5, 20 ms added to each link's round trip with unlimited rate, and a Wi-Fi-like link (30 MB/s
each way, 5 ms RTT). t_split is each system's own per-token time at r = 0; hops = 2 (each worker is one link
away from the host). The floor leaves out transfer time, so rate-capped rows print none; the last column, mesh ÷
stock the same way, is the comparison that holds in every row.

- mesh: three mesh-llm nodes on loopback sized with --max-vram so the plan is host + 2 workers; every node runs
  with MESH_LLM_NETEM (see src/meshllm/net/netem.py), so each QUIC link pays r on its round trip and the rate
  cap on each direction, and so do a worker's direct-path and peer listeners (delay relays in front of them,
  src/meshllm/delaytcp.py). The nodes run with --rpc-path tunnel (default) or, with ``--rpc-path auto``, on
  the default path: TCP + TLS to each worker, the hidden state worker to worker.
- stock, same way: stock llama-server + stock rpc-servers with the mesh plan's layer counts; the two workers sit
  behind a TCP delay proxy (this file: r/2 each direction, same rate cap, TCP_NODELAY), the host's own rpc-server
  is local. At r = 0 there is no proxy: plain loopback TCP, stock at its best.
- stock, 2 workers: what the issue measured: all layers (and the output) on the two proxied workers, so the
  logits (1 MiB per token for this vocabulary) cross a link every token.

Decode speed is llama-server's own timing (predicted_per_second) of greedy completions; medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import header  # benchmarks/common.py: the command line and machine
from tests.integration.meshlab import NodeProc, wait_for

from meshllm.delaytcp import DelayProxy
from meshllm.llama.build import find_binaries
from meshllm.llama.processes import (
    Child,
    free_port,
    llama_server_argv,
    rpc_server_argv,
    wait_http_ready,
    wait_tcp_ready,
)
from meshllm.models.tiny import tiny_model_path

PROFILES = [("r = 0 ms", 0.0, 0.0), ("r = 5 ms", 5.0, 0.0), ("r = 20 ms", 20.0, 0.0),
            ("Wi-Fi: 30 MB/s, 5 ms", 5.0, 30.0)]  # fmt: skip
HOPS = 2


def completion(port: int, path: str, n: int) -> float:
    body = {"prompt": "Once upon a time", "n_predict": n, "max_tokens": n, "temperature": 0, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return float(json.loads(r.read())["timings"]["predicted_per_second"])


def mesh_run(tmp: Path, model: Path, rtt: float, rate: float, runs: int, n: int, rpc_path: str = "tunnel"
             ) -> tuple[list[float], list[int]]:  # fmt: skip
    env = {"MESH_LLM_NETEM": f"rtt={rtt},rate={rate}"}
    args = ("--ctx-size", "1024", "--rpc-path", rpc_path)
    a = NodeProc(tmp, "a", model, "--max-vram", "0.446", *args, env=env)  # 0.5 now holds the whole model
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "token")
        token = (a.state / "token").read_text().strip()
        for name in "bd":
            nodes.append(NodeProc(tmp, name, model, "--max-vram", "0.07", *args, "--join", token, env=env))

        def three() -> bool:
            p = a.status().get("plan")
            return "ready:" in a.text() and isinstance(p, dict) and len(p.get("assignments", [])) == 3

        wait_for(three, 180, "a 3-way split")
        counts = [int(x["count"]) for x in a.status()["plan"]["assignments"]]  # type: ignore[index]
        completion(a.port, "/v1/completions", 8)
        return [completion(a.port, "/v1/completions", n) for _ in range(runs)], counts
    finally:
        for node in nodes:
            node.stop()


def stock_run(tmp: Path, model: Path, counts: list[int], proxied: int, rtt: float, rate: float, runs: int,
              n: int) -> list[float]:  # fmt: skip
    """Stock binaries, one rpc-server per entry of ``counts``; the first ``proxied`` behind delay proxies."""
    bins = find_binaries(stock=True)
    children: list[Child] = []
    proxies: list[DelayProxy] = []
    try:
        ports = []
        for i in range(len(counts)):
            port = free_port()
            child = Child.start(f"rpc{i}", rpc_server_argv(bins, port, threads=1), tmp / f"stock-rpc{i}.log")
            children.append(child)
            wait_tcp_ready(child, port)
            if i < proxied and (rtt or rate):  # r = 0 unshaped: plain TCP, no Python proxy in stock's way
                proxies.append(DelayProxy(port, rtt, rate))
                port = proxies[-1].port
            ports.append(port)
        http = free_port()
        rpc = [f"127.0.0.1:{p}" for p in ports]
        argv = llama_server_argv(bins, model, http, ctx_size=1024, threads=2, rpc=rpc, n_gpu_layers=99,
                                 tensor_split=[float(c) for c in counts], extra=["--fit", "off"])  # fmt: skip
        llama = Child.start("llama-server", argv, tmp / "stock-llama.log", env=dict(os.environ))
        children.append(llama)
        wait_http_ready(llama, f"http://127.0.0.1:{http}/health", timeout=300)
        completion(http, "/completion", 8)
        return [completion(http, "/completion", n) for _ in range(runs)]
    finally:
        for ch in reversed(children):
            ch.stop()
        for p in proxies:
            p.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rpc-path", choices=("tunnel", "auto"), default="tunnel",
                    help="the mesh nodes' --rpc-path (auto: direct TCP + TLS, worker to worker)")  # fmt: skip
    args = ap.parse_args()
    header()
    model = tiny_model_path()
    res: dict[str, dict[str, float]] = {"mesh": {}, "stock, same way": {}, "stock, 2 workers": {}}
    counts: list[int] = []
    with tempfile.TemporaryDirectory(prefix="mesh-llm-latency-") as tmpd:
        for i, (name, rtt, rate) in enumerate(PROFILES):
            tmp = Path(tmpd) / str(i)
            tmp.mkdir()
            got, counts = mesh_run(tmp, model, rtt, rate, args.runs, args.tokens, args.rpc_path)
            res["mesh"][name] = statistics.median(got)
            res["stock, same way"][name] = statistics.median(
                stock_run(tmp, model, counts, 2, rtt, rate, args.runs, args.tokens))  # fmt: skip
            two = [counts[0], sum(counts) - counts[0]]
            res["stock, 2 workers"][name] = statistics.median(
                stock_run(tmp, model, two, 2, rtt, rate, args.runs, args.tokens))  # fmt: skip
            print(f"{name}: " + ", ".join(f"{k} {v[name]:.1f} tok/s" for k, v in res.items()), flush=True)
    print(f"\ntiny model, {args.tokens} tokens greedy, median of {args.runs} runs; mesh layer counts {counts} "
          f"(worker, worker, host); hops = {HOPS}\n")  # fmt: skip
    # "of floor" compares each system with its own r = 0 speed plus the added round trips; it is 1.00 at r = 0 by
    # construction, so the last column compares the systems themselves: the mesh against stock RPC the same way
    print("| profile | " + " | ".join(f"{k} tok/s | floor | of floor" for k in res) + " | mesh ÷ stock |")
    print("|---|" + "---:|---:|---:|" * len(res) + "---:|")
    for name, rtt, rate in PROFILES:
        cells = []
        for v in res.values():
            t0 = 1.0 / v[PROFILES[0][0]]
            floor = 1.0 / (t0 + HOPS * rtt / 1000.0)
            # under a rate cap the floor would need each system's bytes per token on each link, which this script
            # does not measure: no floor there, and that row compares the systems only (last column)
            cells.append(f"{v[name]:.1f} | — | —" if rate else f"{v[name]:.1f} | {floor:.1f} | {v[name] / floor:.2f}")
        versus = res["mesh"][name] / res["stock, same way"][name]
        print(f"| {name} | " + " | ".join(cells) + f" | {versus:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
