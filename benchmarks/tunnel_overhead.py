"""tok/s of a 2-node split through mesh-llm (its default RPC path, then its QUIC tunnels) vs the same split over
plain loopback TCP.

    .venv/bin/python benchmarks/tunnel_overhead.py [--runs 5] [--tokens 64]

Mesh: two mesh-llm nodes on loopback sized with --max-vram so the plan splits (worker: first layers, host: the
rest and the output on its own rpc-server), once with the default --rpc-path auto (the worker reached over TCP +
TLS 1.3) and once with --rpc-path tunnel. Direct: the same binaries and layer split, llama-server --rpc
straight to two rpc-servers on loopback (plain TCP: no tunnel, no TLS, no relay of any kind). Decode speed is
llama-server's own timing of each greedy completion (predicted_per_second); also the latency the :9337 proxy
adds (solo node vs its llama-server). Medians of --runs runs, in one script run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import header  # benchmarks/common.py: the command line and machine
from tests.integration.meshlab import NodeProc, wait_for
from tests.integration.splitlab import Worker, start_split, stop_split
from tests.integration.test_serve_split import llama_server_port

from meshllm.llama.build import find_binaries
from meshllm.llama.processes import Child
from meshllm.llama.rpcwire import CountingRelay
from meshllm.models.tiny import tiny_model_path


def completion(port: int, path: str, n: int, key: str | None = None) -> tuple[float, float]:
    """(decode tok/s as llama-server timed it, wall seconds of the request); ``key``: llama-server's own (asked
    directly, it answers nobody without it)"""
    body = {"prompt": "Once upon a time", "n_predict": n, "max_tokens": n, "temperature": 0, "cache_prompt": False}
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **auth})  # fmt: skip
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return float(out["timings"]["predicted_per_second"]), time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    header()
    model = tiny_model_path()
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="mesh-llm-bench-") as tmpd:
        tmp = Path(tmpd)
        for rpc_path, label in (("auto", "mesh split, default path (direct TCP + TLS)"),
                                ("tunnel", "mesh split, --rpc-path tunnel (QUIC)")):  # fmt: skip
            a = NodeProc(tmp, f"a-{rpc_path}", model, "--max-vram", "0.446", "--ctx-size", "1024",
                         "--rpc-path", rpc_path)  # 0.5 holds the whole model now: no split
            nodes = [a]
            try:
                wait_for(lambda a=a: (a.state / "token").exists(), 30, "token")
                b = NodeProc(tmp, f"b-{rpc_path}", model, "--max-vram", "0.3", "--ctx-size", "1024", "--join",
                             (a.state / "token").read_text().strip(), "--rpc-path", rpc_path)  # fmt: skip
                nodes.append(b)
                wait_for(lambda a=a: "ready:" in a.text(), 120, "host ready")
                st = a.status()
                plan = st["plan"]
                counts = [float(x["count"]) for x in plan["assignments"]]  # type: ignore[index]
                paths = [str(p["rpc_path"]) for p in st["peers"] if p.get("rpc_path")]  # type: ignore[attr-defined]
                completion(a.port, "/v1/completions", 8)
                mesh = [completion(a.port, "/v1/completions", args.tokens) for _ in range(args.runs)]
                rows[f"{label}: {'; '.join(paths)}"] = [m[0] for m in mesh]
            finally:
                for n in nodes:
                    n.stop()
        bins = find_binaries()
        children: list[Child] = []
        relays: list[CountingRelay] = []
        s = start_split(tmp / "direct", bins, [Worker(bins, model), Worker(bins, model)], model, children, relays,
                        threads=2, tensor_split=counts, extra=["--fit", "off"], counted=False)  # fmt: skip
        try:
            completion(s.port, "/completion", 8)
            rows["direct split (TCP, no tunnel)"] = [completion(s.port, "/completion", args.tokens)[0]
                                                     for _ in range(args.runs)]  # fmt: skip
        finally:
            stop_split(s)
            for r in relays:
                r.close()
        solo = NodeProc(tmp, "solo", model, "--ctx-size", "1024")
        try:
            wait_for(lambda: "ready:" in solo.text(), 120, "solo ready")
            direct_port = llama_server_port(solo)
            completion(solo.port, "/v1/completions", 8)
            via = [completion(solo.port, "/v1/completions", 1)[1] * 1000 for _ in range(max(args.runs, 20))]
            key = (solo.state / "llama-server.key").read_text().strip()
            raw = [completion(direct_port, "/v1/completions", 1, key)[1] * 1000 for _ in range(max(args.runs, 20))]
            rows["solo (tok/s)"] = [completion(solo.port, "/v1/completions", args.tokens)[0] for _ in range(args.runs)]
        finally:
            solo.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"tiny model, {args.tokens} tokens greedy, median of {args.runs} runs\n")
    print("| setup | decode tok/s |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} |")
    for k, v in med.items():
        if k.startswith("mesh"):
            print(f"{k} ÷ direct split = {v / med['direct split (TCP, no tunnel)']:.2f}")
    q = statistics.quantiles
    print("\n| 1-token request | p50 ms | p99 ms |\n|---|---:|---:|")
    print(f"| through :9337 (solo node) | {statistics.median(via):.1f} | {q(via, n=100)[98]:.1f} |")
    print(f"| llama-server directly | {statistics.median(raw):.1f} | {q(raw, n=100)[98]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
