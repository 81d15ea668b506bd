"""Where a 2-node split's start → ready goes, next to llama.cpp's own start and load of the same split.

    .venv/bin/python benchmarks/start_ready.py [--runs 3]

Node a (0.446 GB offered) founds the mesh with the tiny model; b (0.3 GB) is started with a's token as soon as the
token exists, so the plan splits the model over both. The phases, from the script's clock and each node's timeline
(its status.json events, to 0.1 s):

  a up       a started → a's invite token written (imports, binaries checked, rpc-server up, mesh founded)
  b joined   b started → a's timeline says b joined (b's own start-up, its dial and admission)
  plan       b joined → a adopts the split (the plan waits PLAN_DEBOUNCE_S without a change: joins come in bursts)
  load       plan → a says ready (b's key for the direct path, llama-server started and loaded over RPC)
  total      b started → a ready (what a user waits once both machines are told to go)

Stock, the same split by hand: b's rpc-server started alone, then llama-server --rpc with the plan's tensor split;
its time is llama-server's start → /health 200 (model load over RPC: the part nothing can cut). Median of --runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import header  # benchmarks/common.py: the command line and machine
from tests.integration.meshlab import NodeProc, wait_for

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

PHASES = ("a up", "b joined", "plan", "load", "total")


def _event(node: NodeProc, kind: str, text: str = "") -> float | None:
    """Wall time of the first timeline event of ``kind`` (whose text has ``text``), or None."""
    for e in node.status().get("events", []):  # type: ignore[attr-defined]
        if e.get("kind") == kind and text in str(e.get("text", "")):
            return float(e["t"])
    return None


def mesh_run(tmp: Path, model: Path) -> tuple[dict[str, float], list[int]]:
    t_a = time.time()
    a = NodeProc(tmp, "a", model, "--max-vram", "0.446", "--ctx-size", "1024")  # 0.5 holds the whole model now
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists(), 60, "a's token")
        t_up = time.time()
        b = NodeProc(tmp, "b", model, "--max-vram", "0.3", "--ctx-size", "1024", "--join",
                     (a.state / "token").read_text().strip())  # fmt: skip
        t_b = time.time()
        nodes.append(b)

        def ready() -> bool:
            p = a.status().get("plan")
            return _event(a, "ready") is not None and isinstance(p, dict) and len(p.get("assignments", [])) == 2

        wait_for(ready, 180, "a to serve a split with b")
        joined = _event(a, "joined") or t_b
        plan = next(float(e["t"]) for e in a.status()["events"] if e["kind"] == "plan"  # type: ignore[attr-defined]
                    and "layers" in str(e["text"]) and b.short() in str(e["text"]))  # fmt: skip
        done = _event(a, "ready")
        assert done is not None
        counts = [int(x["count"]) for x in a.status()["plan"]["assignments"]]  # type: ignore[index]
        return {"a up": t_up - t_a, "b joined": joined - t_b, "plan": plan - joined, "load": done - plan,
                "total": done - t_b}, counts  # fmt: skip
    finally:
        for n in nodes:
            n.stop()


def stock_run(tmp: Path, model: Path, counts: list[int]) -> float:
    bins = find_binaries(stock=True)
    children: list[Child] = []
    try:
        port = free_port()
        rpc = Child.start("rpc", rpc_server_argv(bins, port, threads=1), tmp / "stock-rpc.log")
        children.append(rpc)
        wait_tcp_ready(rpc, port)
        http = free_port()
        argv = llama_server_argv(bins, model, http, ctx_size=1024, threads=2, rpc=[f"127.0.0.1:{port}"],
                                 n_gpu_layers=99, tensor_split=[float(c) for c in counts],
                                 extra=["--fit", "off"])  # fmt: skip
        t0 = time.time()
        llama = Child.start("llama-server", argv, tmp / "stock-llama.log", env=dict(os.environ))
        children.append(llama)
        wait_http_ready(llama, f"http://127.0.0.1:{http}/health", timeout=300)
        return time.time() - t0
    finally:
        for ch in reversed(children):
            ch.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    header()
    model = tiny_model_path()
    rows: dict[str, list[float]] = {p: [] for p in PHASES}
    stock: list[float] = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="start-ready-") as d:
            got, counts = mesh_run(Path(d), model)
            for k, v in got.items():
                rows[k].append(v)
            stock.append(stock_run(Path(d), model, counts))
        said = ", ".join(f"{k} {v:.1f} s" for k, v in got.items())
        print(f"run {i + 1}: {said}; stock load {stock[-1]:.1f} s", flush=True)
    print(f"\nstart → ready of a 2-node split of the tiny model (layers {counts}), median of {args.runs} runs\n")
    print("| phase | seconds |\n|---|---:|")
    for p in PHASES:
        print(f"| {p} | {statistics.median(rows[p]):.1f} |")
    med = statistics.median(stock)
    print(f"| stock llama-server --rpc, start → /health 200 (the load itself) | {med:.1f} |")
    print(f"\nmesh total ÷ stock load: {statistics.median(rows['total']) / med:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
