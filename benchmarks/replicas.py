"""Replicas on this machine's CPU, tiny model: many clients on one model served by one node and by
two nodes that each hold it whole (the second serves a replica), each node pinned to a CPU of its own (``taskset``:
two one-CPU machines), next to llama-server alone on one CPU and two llama-servers on one CPU each with the clients
split between them (the best stock setup for two machines: clients that share themselves out).

    .venv/bin/python benchmarks/replicas.py [--clients 16] [--parallel 16] [--ctx 512] [--tokens 32] [--runs 3]
    .venv/bin/python benchmarks/replicas.py --kill [--runs 3]

Every client streams --tokens greedy tokens after a 32-token prompt of its own, all at node a's API (the replica
row: the mesh spreads them); aggregate generated tokens per wall second, the median of --runs; time to first token
over every request of those runs.

--kill: a greedy answer of 200 tokens streamed through a lite client (a third node, no CPU of its own) while both
serve; the node running it (its own record says a slot is busy) is killed -9 after 30 tokens. The client's longest
wait between two events, against the same answer uninterrupted; a fresh mesh for each of --runs runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import header  # benchmarks/common.py: the command line and machine
from loadgen import concurrent, ids, one, pct, wait_until

ROOT = Path(__file__).resolve().parents[1]


def get(port: int, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class Pair:
    """One or two mesh nodes, each pinned to one CPU (``cpus``); a founds the mesh, b joins it."""

    def __init__(self, tmp: Path, model: Path, cpus: list[int], args: list[str], lite: bool = False) -> None:
        """``lite``: and a lite client (the last port)."""
        self.tmp, self.procs, self.ports = tmp, [], []
        for i, cpu in enumerate([*cpus, -1] if lite else cpus):
            port = _free_port()
            which = ["--client"] if cpu < 0 else ["--model", str(model), *args]
            cmd = [*(["taskset", "-c", str(cpu)] if cpu >= 0 else []), sys.executable, "-m", "meshllm.cli", *which,
                   "--state-dir", str(tmp / f"n{i}"), "--port", str(port), "--bind-host", "127.0.0.1"]  # fmt: skip
            if i:
                cmd += ["--join-file", str(tmp / "n0" / "token")]
            self.procs.append(subprocess.Popen(cmd, stdout=(tmp / f"n{i}.log").open("wb"), stderr=subprocess.STDOUT,
                                               start_new_session=True))  # fmt: skip
            self.ports.append(port)
            if i == 0:
                wait_until(lambda: (tmp / "n0" / "token").is_file(), 60, "the founder's token")
        name = model.stem

        def all_serve() -> bool:
            try:
                m = next(x for x in get(self.ports[0], "/v1/models")["data"] if x["id"] == name)  # type: ignore[attr-defined]
            except (OSError, StopIteration):
                return False
            info = m.get("meshllm", {})
            return info.get("state") == "serving" and len(info.get("replicas", [])) == len(cpus) - 1

        wait_until(all_serve, 180, "the mesh to serve")
        if lite:
            wait_until(lambda: self.text(len(cpus)).count("API up:") >= len(cpus), 60, "the lite client's tunnels")
        wait_until(lambda: all("ready:" in self.text(i) for i in range(len(cpus))), 60, "every llama-server")

    def text(self, i: int) -> str:
        return (self.tmp / f"n{i}.log").read_text(errors="replace")

    def busy(self, i: int) -> int:
        me = next(p for p in get(self.ports[i], "/mesh/status")["peers"] if p["path"] == "self")  # type: ignore[attr-defined]
        return int((me.get("slots") or [0])[0])

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _free_port() -> int:
    from meshllm.llama.processes import free_port

    return free_port()


def stream(port: int, body: dict[str, object], stamps: list[float], on_event: object = None) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
                text.append(json.loads(line[6:])["choices"][0].get("text") or "")
                if callable(on_event):
                    on_event(len(stamps))
    return "".join(text)


def longest_gap(stamps: list[float]) -> float:
    return max((y - x for x, y in itertools.pairwise(stamps)), default=0.0)


def kill_once(pair: Pair) -> tuple[int, float, float, bool]:
    """(the node killed, the longest wait uninterrupted, the longest wait with the kill, whether the text is the
    same)."""
    body = {"prompt": "Count from 1 to 100, separated by commas: 1, 2,", "max_tokens": 200, "temperature": 0,
            "stream": True}  # fmt: skip
    ref_stamps: list[float] = []
    ref = stream(pair.ports[2], body, ref_stamps)
    wait_until(lambda: not pair.busy(0) and not pair.busy(1), 10, "both idle")
    stamps: list[float] = []
    go = threading.Event()
    out: list[str] = []
    th = threading.Thread(target=lambda: out.append(stream(pair.ports[2], body, stamps,
                                                           lambda k: k == 30 and go.set())))  # fmt: skip
    th.start()
    assert go.wait(60)
    wait_until(lambda: pair.busy(0) + pair.busy(1) == 1, 10, "the answer's host")
    victim = 0 if pair.busy(0) else 1
    pair.procs[victim].send_signal(signal.SIGKILL)
    th.join(300)
    return victim, longest_gap(ref_stamps), longest_gap(stamps), out == [ref]


def kill_runs(model: Path, tmp: Path, runs: int, args: list[str]) -> None:
    rows = []
    for run in range(runs):
        d = tmp / f"kill{run}"
        d.mkdir()
        pair = Pair(d, model, [0, 1], args, lite=True)
        try:
            rows.append(kill_once(pair))
            same = rows[-1][3]
            victim = rows[-1][0]
            print(f"run {run + 1}: killed {'the elected host' if victim == 0 else 'the replica'} (n{victim}) "
                  f"after 30 tokens: longest wait {rows[-1][2]:.2f} s (uninterrupted {rows[-1][1]:.2f} s), "
                  f"same text: {same}", flush=True)
        finally:
            pair.stop()
    print(f"\n# 2 replicas (one CPU each), tiny model, a 200-token greedy answer streamed through a lite client, the "
          f"node running it killed -9 after 30 tokens; {runs} runs")
    print("| run | killed | longest wait uninterrupted s | longest wait with the kill s | extra s | same text |")
    print("|---:|---|---:|---:|---:|---|")
    for i, (victim, ref_gap, gap, same) in enumerate(rows):
        print(f"| {i + 1} | {'elected host' if victim == 0 else 'replica'} | {ref_gap:.2f} | {gap:.2f} | "
              f"{gap - ref_gap:.2f} | {'yes' if same else 'NO'} |")
    print(f"median extra wait: {statistics.median(r[2] - r[1] for r in rows):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=16, help="slots of every server")
    ap.add_argument("--ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kill", action="store_true", help="instead: a host killed -9 mid-stream (see above)")
    args = ap.parse_args()
    header()
    assert len(os.sched_getaffinity(0)) >= 2, "needs two CPUs"
    sys.path.insert(0, str(ROOT / "src"))
    from meshllm.llama.build import find_binaries
    from meshllm.llama.processes import Child, free_port, llama_server_argv, wait_http_ready
    from meshllm.models.tiny import tiny_model_path

    bins, model = find_binaries(), tiny_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="mesh-replicas-"))
    node_args = ["--parallel", str(args.parallel), "--ctx-size", str(args.ctx)]
    try:
        if args.kill:
            kill_runs(model, tmp, args.runs, node_args)
            return
        results: list[tuple[str, tuple[float, list[float]]]] = []

        def measure(bases: list[str]) -> tuple[float, list[float]]:
            for b in bases:
                one(b, "/v1/completions", ids(32, 1), 4)  # warm-up
            return concurrent(bases, "/v1/completions", args.clients, args.tokens, args.runs, seed=100)

        servers = []
        try:
            for cpu in (0, 1):
                port = free_port()
                taskset = [shutil.which("taskset") or "taskset", "-c", str(cpu)]
                argv = [*taskset, *llama_server_argv(bins, model, port, ctx_size=args.ctx, parallel=args.parallel,
                                                     threads=1)]  # fmt: skip
                servers.append((Child.start(f"llama-{cpu}", argv, tmp / f"llama-{cpu}.log"), port))
            for c, port in servers:
                wait_http_ready(c, f"http://127.0.0.1:{port}/health", 120)
            results.append(("llama-server alone, 1 CPU", measure([f"http://127.0.0.1:{servers[0][1]}"])))
            results.append(("2 llama-servers, 1 CPU each, clients split between them",
                            measure([f"http://127.0.0.1:{p}" for _, p in servers])))  # fmt: skip
        finally:
            for c, _ in servers:
                c.stop()
        for cpus, name in (([0], "mesh-llm, 1 node (1 CPU)"),
                           ([0, 1], "mesh-llm, 2 nodes: host + replica (1 CPU each)")):  # fmt: skip
            d = tmp / f"mesh{len(cpus)}"
            d.mkdir()
            pair = Pair(d, model, cpus, node_args)
            try:
                results.append((name, measure([f"http://127.0.0.1:{pair.ports[0]}"])))
                ran = [(d / f"n{i}" / "llama-server.log").read_text(errors="replace").count("prompt eval time")
                       for i in range(len(cpus))]  # fmt: skip
                print(f"{name}: requests each node's llama-server ran: {ran}", flush=True)
            finally:
                pair.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    one_ = dict(results)
    print(f"\n# this machine's CPU, tiny model, every server --parallel {args.parallel} x {args.ctx} tokens, one CPU "
          f"each (taskset, llama.cpp --threads 1); {args.clients} clients x {args.tokens} greedy tokens; aggregate: "
          f"median of {args.runs} runs; TTFT over every request of those runs")  # fmt: skip
    print("| setup | aggregate tok/s | ÷ its one-server row | TTFT p50 s | TTFT p95 s |\n|---|---:|---:|---:|---:|")
    for name, (agg, tt) in results:
        base = one_["mesh-llm, 1 node (1 CPU)" if name.startswith("mesh") else "llama-server alone, 1 CPU"][0]
        print(f"| {name} | {agg:.1f} | {agg / base:.2f} | {pct(tt, 0.5):.3f} | {pct(tt, 0.95):.3f} |")


if __name__ == "__main__":
    main()
