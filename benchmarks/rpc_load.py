"""Stock vs patched llama.cpp RPC on the same model and split: what crosses the wire and what the host reads.

    .venv/bin/python benchmarks/rpc_load.py [--model PATH] [--runs 3]

Two rpc-servers (1 thread each) behind counting relays on loopback, llama-server --rpc to both, all layers
offloaded (-ngl 99), --load-mode none. "stock": stock binaries, workers without a model file. "patched":
patched binaries, each worker with --gguf on its own copy of the same file. Load time is from starting
llama-server to /health answering 200; per-token numbers are the difference between an 80- and a 16-token
greedy completion, divided by 64. Medians over --runs runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import header  # benchmarks/common.py: the command line and machine
from tests.integration.splitlab import Worker, start_split, stop_split

from meshllm.llama.build import find_binaries
from meshllm.llama.processes import Child
from meshllm.llama.rpcwire import Cmd, CountingRelay, WireStats
from meshllm.models.tiny import tiny_model_path

MiB = 1024 * 1024


def complete(port: int, n: int) -> dict[str, object]:
    body = json.dumps({"prompt": "Once upon a time", "n_predict": n, "temperature": 0, "cache_prompt": False})
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def one_run(flavour: str, model: Path, tmp: Path) -> dict[str, float]:
    bins = find_binaries(stock=flavour == "stock")
    workers = [Worker(bins, model if flavour == "patched" else None) for _ in range(2)]
    children: list[Child] = []
    relays: list[CountingRelay] = []
    t0 = time.monotonic()
    s = start_split(tmp, bins, workers, model, children, relays)
    load_s = time.monotonic() - t0
    try:
        rchar = s.rchar()
        complete(s.port, 4)  # warm-up
        per_token: list[WireStats] = []
        a = [r.snapshot() for r in s.relays]
        complete(s.port, 16)
        b = [r.snapshot() for r in s.relays]
        timing = complete(s.port, 80)
        c = [r.snapshot() for r in s.relays]
        per_token = [cc.minus(bb).minus(bb.minus(aa)) for aa, bb, cc in zip(a, b, c, strict=True)]
        tps = float(timing["timings"]["predicted_per_second"])  # type: ignore[index]
    finally:
        stop_split(s)
        for ch in children:
            ch.stop()
    row: dict[str, float] = {"load_s": load_s, "host_read_mb": rchar / 1e6, "tok_s": tps}
    for i, (ld, pt) in enumerate(zip(s.load, per_token, strict=True)):
        row[f"w{i}_weights_mb"] = (ld.payload[Cmd.SET_TENSOR] + ld.payload[Cmd.SET_TENSOR_HASH]) / 1e6
        row[f"w{i}_load_rt"] = ld.round_trips
        row[f"w{i}_conns"] = ld.connections
        row[f"w{i}_tok_rt"] = pt.round_trips / 64
        row[f"w{i}_tok_up_kb"] = pt.bytes_up / 64 / 1e3
        row[f"w{i}_tok_down_kb"] = pt.bytes_down / 64 / 1e3
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="GGUF model (default: the tiny test model)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    header()
    model = args.model or tiny_model_path()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="mesh-llm-bench-") as tmpd:
        for flavour in ("stock", "patched"):
            runs = [one_run(flavour, model, Path(tmpd) / f"{flavour}{i}") for i in range(args.runs)]
            results[flavour] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = [
        ("weights on the wire, worker 0 / 1 (MB)", "w0_weights_mb", "w1_weights_mb", "{:.1f}"),
        ("load round trips, worker 0 / 1", "w0_load_rt", "w1_load_rt", "{:.0f}"),
        ("load connections, worker 0 / 1", "w0_conns", "w1_conns", "{:.0f}"),
        ("host bytes read during load (MB, rchar)", "host_read_mb", None, "{:.1f}"),
        ("load time, start to /health (s)", "load_s", None, "{:.2f}"),
        ("per token: blocking round trips, worker 0 / 1", "w0_tok_rt", "w1_tok_rt", "{:.2f}"),
        ("per token: bytes to worker 0 / 1 (kB)", "w0_tok_up_kb", "w1_tok_up_kb", "{:.1f}"),
        ("per token: bytes from worker 0 / 1 (kB)", "w0_tok_down_kb", "w1_tok_down_kb", "{:.1f}"),
        ("decode speed (tok/s)", "tok_s", None, "{:.1f}"),
    ]
    print(f"model {model.name} ({model.stat().st_size / 1e6:.0f} MB), {platform.node()}, "
          f"{platform.processor() or platform.machine()}, median of {args.runs} runs\n")  # fmt: skip
    print("| measure | stock | patched |\n|---|---:|---:|")
    for label, k0, k1, fmt in rows:
        cells = []
        for flavour in ("stock", "patched"):
            r = results[flavour]
            cells.append(fmt.format(r[k0]) + (" / " + fmt.format(r[k1]) if k1 else ""))
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
