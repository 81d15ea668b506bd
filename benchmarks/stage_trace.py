"""Where one token's time goes in a split: each RPC command timestamped on the host and every worker ([pipeline-2] 2).

    .venv/bin/python benchmarks/stage_trace.py [--workers 2] [--tokens 48] [--clients 4]   (this machine, tiny model)
    python3 benchmarks/gpu_split.py --carry gpuc --pipeline --trace [--nodes 2,3,4] [--trace-clients 1,4]  (device)

The chain is llama.cpp's worker-to-worker split (patch 0011): N-1 rpc-servers on loopback, each with a peer
listener, and llama-server with the last layers and the output (``GGML_RPC_PEERS``), every process started with
``GGML_RPC_TRACE`` (patch 0015): one clock for all of them, since they share the machine. After a warm-up, one greedy
completion of --tokens tokens (with --clients C, C of them at once on C slots: each decoding step then carries one
token of every client through the chain); each step is cut into the segments of its critical path:

  host → w0     from the host having the last worker's output (GET_TENSOR back) to the first worker's compute:
                the host's own layers, output and sampling and the next token's graph (to its first command queued
                for w0), the next token's inputs and graph queued for w0 (first to last), then to w0's compute
                start (written, read, set)
  compute wK    worker K's graph compute (GRAPH_RECOMPUTE: the graph is kept on the server across tokens)
  wK → wK+1     from K's compute done to K+1's compute start: K's device → host copy of the hidden state (D2H),
                the frame on the peer link (link), K+1's thread waking on it (wake), its host → device copy and the
                command that starts the compute (set+start)
  wLast → host  from the last worker's compute done to the host holding the tensor (the GET's round trip)

Each segment is the median over the decoded tokens (the first two left out), in ms; "stage overhead" is the token's
time less the workers' compute and the host's own part. "host waits per token" counts the times llama-server's
thread slept on a connection (≥ 5 µs: waits on events already done are ~0.1 µs and are left out), "host blocked" adds
up every wait of the token, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

GRAPH_COMPUTE, GET_TENSOR, PEER_SEND, PEER_RECV = 10, 8, 23, 24  # ggml-rpc's command numbers (b11312 + 0011)
BLOCKED_NS = 5_000  # a wait shorter than this found its answer in place: no thread slept (a futex wake takes longer)


@dataclass
class Proc:
    """One process's trace: events as (ns, thread, what, cmd, bytes, tag, peer)."""

    name: str
    events: list[tuple[int, int, str, int, int, int, int]] = field(default_factory=list)
    peers: dict[int, str] = field(default_factory=dict)
    endpoint: str = ""  # a worker's: where the host reaches it


def read_traces(prefix: Path) -> dict[str, Proc]:
    """Every ``PREFIX*.PID`` file, by the name before the pid (``w0``, ``w1``, ..., ``host``)."""
    procs: dict[str, Proc] = {}
    for f in sorted(prefix.parent.glob(prefix.name + "*")):
        name = f.name[len(prefix.name) :].rsplit(".", 1)[0]
        p = procs.setdefault(name, Proc(name))
        for line in f.read_text().splitlines():
            if line.startswith("# peer "):
                _, _, n, ep = line.split(" ", 3)
                p.peers[int(n)] = ep
            elif line and not line.startswith("#"):
                a = line.split()
                p.events.append((int(a[0]), int(a[1]), a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6])))
        p.events.sort()
    return procs


def breakdown(procs: dict[str, Proc], workers: list[str], t0: int, t1: int, skip: int = 2) -> list[tuple[str, float]]:
    """The decode's segments (module docstring), median ms over the tokens computed in [t0, t1] on the first
    worker, ``skip`` first ones (the prompt) left out."""
    host = procs["host"]

    def window(p: Proc, what: str, cmd: int | None = None) -> list[tuple[int, int, str, int, int, int, int]]:
        return [e for e in p.events if t0 <= e[0] <= t1 and e[2] == what and (cmd is None or e[3] == cmd)]

    starts = {w: [e[0] for e in window(procs[w], "C0")] for w in workers}
    ends = {w: [e[0] for e in window(procs[w], "C1")] for w in workers}
    n = min(len(v) for v in starts.values())
    sends = {w: window(procs[w], "B", PEER_SEND) for w in workers}
    d2h = {w: {e[5]: e[0] for e in window(procs[w], "D")} for w in workers}
    arrive = {w: {e[5]: e[0] for e in window(procs[w], "F")} for w in workers}
    woke = {w: {e[5]: e[0] for e in window(procs[w], "G")} for w in workers}
    named = procs[workers[-1]].endpoint  # the host's GETs from the last worker (all of them when unnamed)
    last_ep = next((n for n, ep in host.peers.items() if ep == named), None) if named else None
    got = [e[0] for e in window(host, "S1", GET_TENSOR) if last_ep is None or e[6] == last_ep]
    first_ep = next((n for n, ep in host.peers.items() if ep == procs[workers[0]].endpoint), None)
    to_first = [e[0] for e in window(host, "Q") if e[6] == first_ep] if first_ep is not None else []
    # the host's thread blocked on a connection (a command, a synchronize, an event): W0 → W1 on one thread; a
    # wait that found its answer there already (an event done before it was waited for) takes well under BLOCKED_NS
    held: dict[int, int] = {}
    waits: list[tuple[int, int]] = []  # (released at, ns blocked)
    for e in host.events:
        if e[2] == "W0":
            held[e[1]] = e[0]
        elif e[2] == "W1" and e[1] in held and t0 <= e[0] <= t1:
            waits.append((e[0], e[0] - held.pop(e[1])))
    segs: dict[str, list[float]] = defaultdict(list)
    for i in range(skip, n - 1):
        c0 = {w: starts[w][i] for w in workers}
        c1 = {w: ends[w][i] for w in workers}
        before = [g for g in got if g < c0[workers[0]]]
        if not before:
            continue
        token_ms = (starts[workers[0]][i + 1] - c0[workers[0]]) / 1e6
        segs["token"].append(token_ms)
        segs["host → w0 (host's part)"].append((c0[workers[0]] - before[-1]) / 1e6)
        queued = [q for q in to_first if before[-1] < q < c0[workers[0]]]  # the host's commands to w0 this token
        if queued:
            segs["  own layers, output, sampling, next graph (host)"].append((queued[0] - before[-1]) / 1e6)
            segs["  inputs and graph queued to w0 (host)"].append((queued[-1] - queued[0]) / 1e6)
            segs["  then to w0's compute start"].append((c0[workers[0]] - queued[-1]) / 1e6)
        for k, w in enumerate(workers):
            segs[f"compute {w}"].append((c1[w] - c0[w]) / 1e6)
            if k + 1 < len(workers):
                nxt = workers[k + 1]
                b = next((e for e in sends[w] if e[0] >= c1[w]), None)
                if b is None or b[5] not in d2h[w] or b[5] not in arrive[nxt] or b[5] not in woke[nxt]:
                    continue
                tag = b[5]
                segs[f"{w} → {nxt}"].append((c0[nxt] - c1[w]) / 1e6)
                segs[f"  D2H ({w})"].append((d2h[w][tag] - c1[w]) / 1e6)
                segs[f"  link ({w} → {nxt})"].append((arrive[nxt][tag] - d2h[w][tag]) / 1e6)
                segs[f"  wake ({nxt})"].append((max(woke[nxt][tag], arrive[nxt][tag]) - arrive[nxt][tag]) / 1e6)
                segs[f"  set+start ({nxt})"].append((c0[nxt] - max(woke[nxt][tag], arrive[nxt][tag])) / 1e6)
        last = workers[-1]
        after = [g for g in got if g > c1[last]]
        if after:
            segs[f"{last} → host"].append((after[0] - c1[last]) / 1e6)
        # how often, and how long, the host's thread blocked on a connection this token
        end = starts[workers[0]][i + 1]
        mine = [ns for t, ns in waits if c0[workers[0]] <= t < end]
        segs["host waits per token"].append(float(sum(1 for ns in mine if ns >= BLOCKED_NS)))
        segs["host blocked per token"].append(sum(mine) / 1e6)
    rows = [(k, statistics.median(v)) for k, v in segs.items() if v]
    med = dict(rows)
    compute = sum(med.get(f"compute {w}", 0.0) for w in workers)
    rows.append(("stage overhead (token − compute − host's part)",
                 med["token"] - compute - med["host → w0 (host's part)"]))  # fmt: skip
    rows.append(("tokens", float(len(segs["token"]))))
    last = ("host waits per token", "host blocked per token")
    return [(k, v) for k, v in rows if k not in last] + [(k, med[k]) for k in last]


def print_table(title: str, rows: list[tuple[str, float]]) -> None:
    print(f"\n{title}\n| segment | ms (median) |\n|---|---:|")
    for k, v in rows:
        print(f"| {k} | {v:.0f} |" if k in ("tokens", "host waits per token") else f"| {k} | {v:.3f} |")


def complete(base: str, tokens: int, clients: int = 1) -> None:
    """``clients`` greedy completions of ``tokens`` tokens at once (the same prompt: they decode in step)."""
    body = {"prompt": "Once upon a time, in a land far away,", "n_predict": tokens, "temperature": 0,
            "cache_prompt": False, "ignore_eos": True}  # fmt: skip

    def one(_: int) -> None:
        req = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(clients)))


def traced_chain(bins: object, model: Path, n_workers: int, tokens: int, work: Path, layers: list[int],
                 devices: list[dict[str, str]] | None = None, host_env: dict[str, str] | None = None,
                 clients: int = 1) -> list[tuple[str, float]]:  # fmt: skip
    """Start the chain (module docstring) with tracing, decode once (``clients`` streams at once), return the
    breakdown. ``devices``: each process's environment for its device (workers first, the host last); ``layers``
    per process, the host's last."""
    from meshllm.llama.processes import (
        Child,
        free_port,
        llama_server_argv,
        rpc_server_argv,
        wait_http_ready,
        wait_tcp_ready,
    )

    devices = devices or [dict(os.environ) for _ in range(n_workers + 1)]
    prefix = work / "trace"
    for f in work.glob("trace*"):
        f.unlink()
    children: list[Child] = []
    try:
        eps, peers = [], []
        for i in range(n_workers):
            peer = free_port(avoid=peers)
            port = free_port(avoid=[*peers, peer])
            env = {**devices[i], "GGML_RPC_PEER_LISTEN": f"127.0.0.1:{peer}", "GGML_RPC_TRACE": f"{prefix}w{i}"}
            c = Child.start(f"trace-w{i}", rpc_server_argv(bins, port), work / f"w{i}.log", env=env)  # type: ignore[arg-type]
            children.append(c)
            wait_tcp_ready(c, port, 60)
            eps.append(f"127.0.0.1:{port}")
            peers.append(peer)
        port = free_port()
        split = [float(x) for x in layers]
        split[-1] += 1  # the host's entry counts the output layer
        argv = llama_server_argv(bins, model, port, ctx_size=2048, parallel=clients, rpc=eps, n_gpu_layers=999,  # type: ignore[arg-type]
                                 tensor_split=split, extra=("--fit", "off"))  # fmt: skip
        env = {**devices[-1], **(host_env or {}), "GGML_RPC_TRACE": f"{prefix}host",
               "GGML_RPC_PEERS": ",".join(f"{ep}=127.0.0.1:{p}" for ep, p in zip(eps, peers, strict=True))}  # fmt: skip
        c = Child.start("trace-host", argv, work / "host.log", env=env)
        children.append(c)
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(c, base + "/health", 600)
        complete(base, 8, clients)  # warm-up: links, graphs
        t0 = time.monotonic_ns()
        complete(base, tokens, clients)
        t1 = time.monotonic_ns()
        time.sleep(0.3)  # the processes write their traces every 50 ms
    finally:
        for c in reversed(children):
            c.stop()
    procs = read_traces(prefix)
    for i, ep in enumerate(eps):
        procs[f"w{i}"].endpoint = ep
    return breakdown(procs, [f"w{i}" for i in range(n_workers)], t0, t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--clients", type=int, default=1, help="streams at once, on as many slots (default 1)")
    ap.add_argument("--model", type=Path, default=None, help="default: the tiny test model")
    ap.add_argument(
        "--host-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="in llama-server's environment (e.g. GGML_RPC_QUEUE_INPUTS=0: patch 0016 off)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from provenance import header  # benchmarks/provenance.py

    from meshllm.llama.build import find_binaries
    from meshllm.llama.gguf import layer_of, read_header
    from meshllm.models.tiny import tiny_model_path

    header()
    model = args.model or tiny_model_path()
    n_layer = 1 + max(x for t in read_header(model).tensors if (x := layer_of(t.name)) is not None)
    n = args.workers  # a CPU host has no device of its own in llama.cpp's split: its workers take every layer
    layers = [n_layer // n + (1 if i < n_layer % n else 0) for i in range(n)] + [0]
    work = Path(tempfile.mkdtemp(prefix="stage-trace-"))
    host_env = dict(x.split("=", 1) for x in args.host_env)
    rows = traced_chain(find_binaries(stock=False), model, args.workers, args.tokens, work, layers, None, host_env,
                        args.clients)  # fmt: skip
    many = f" × {args.clients} clients" if args.clients > 1 else ""
    print_table(f"# {model.name}: {args.workers} workers + host on this machine's CPU, layers {layers[:-1]} "
                f"(the output on the last worker){' ' + ' '.join(args.host_env) if args.host_env else ''}, "
                f"{args.tokens} greedy tokens{many}", rows)  # fmt: skip


if __name__ == "__main__":
    main()
