"""What the benchmarks share besides their clients (``loadgen.py``); no benchmark imports another.

- What produced a table: the command line and the machine, printed above it (``header``), so a number quoted from it
  carries both. Every benchmark's ``main`` calls it once its arguments parse.
- Bytes through the host per generated token, from counting relays in front of the workers (``per_token``,
  ``print_bytes_table``): ``host_bytes.py`` on the tiny model, ``gpu_split.py --bytes`` on the 8B shape.
- Where one token's time goes in a split, from every process's RPC trace (patch 0015; ``traced_chain``,
  ``breakdown``, ``print_trace_table``): ``stage_trace.py`` on the tiny model, ``gpu_split.py --pipeline --trace``
  on a GPU. The chain: N-1 rpc-servers on loopback, each with a peer listener, and llama-server with the last layers
  and the output (``GGML_RPC_PEERS``), every process started with ``GGML_RPC_TRACE``; ``stage_trace.py``'s docstring
  says what each segment is.

Only the standard library at import time (meshllm is imported where it is used), so ``header`` runs on the lent GPU
machine before the carried wheels are installed."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshllm.llama.rpcwire import CountingRelay


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


# ------------------------------------------------------------------------------ bytes through the host per token


@dataclass
class Bytes:
    up: float  # llama-server -> the workers, B/token, graphs included
    graphs: float  # of which whole graphs sent again
    down: float  # the workers -> llama-server
    digest: str  # of the generated token ids

    @property
    def total(self) -> float:
        """Both ways, less whole graphs sent again (once per 256 cells: over a short window one such send would
        count as if every token paid it)."""
        return self.up - self.graphs + self.down


def per_token(port: int, relays: Sequence[CountingRelay], prompt: list[int], n: int) -> Bytes:
    """Stream ``n`` greedy tokens after ``prompt`` (token ids) from llama-server on ``port``; what crossed ``relays``
    from the third token to the last, per token."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "ignore_eos": True,
            "stream": True, "return_tokens": True}  # fmt: skip
    c.request("POST", "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()[:300]
    from meshllm.llama.rpcwire import Cmd, WireStats

    before: list[WireStats] = []
    toks: list[int] = []
    seen = 0
    for line in r:
        if line.startswith(b"data: {"):
            chunk: dict[str, Any] = json.loads(line[6:])
            toks += chunk.get("tokens") or []
            seen += 1
            if seen == 2:
                before = [x.snapshot() for x in relays]
    c.close()
    assert seen >= n and before, f"{seen} chunks streamed"
    d = [x.snapshot().minus(b) for x, b in zip(relays, before, strict=True)]
    k = n - 2
    graphs = sum(a.payload[Cmd.GRAPH_COMPUTE] for a in d) / k
    digest = hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:8]
    return Bytes(sum(a.bytes_up for a in d) / k, graphs, sum(a.bytes_down for a in d) / k, digest)


def print_bytes_table(title: str, rows: list[tuple[str, dict[int, Bytes]]]) -> None:
    """One row per setup and context; ÷ star against the first setup at the same context."""
    print(f"\n# {title}")
    print("| setup | context | to the workers B/token | of which graphs | back B/token | total less graphs | ÷ star | "
          "÷ own at the shortest | text |\n|---|---:|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    star = rows[0][1]
    for name, by_ctx in rows:
        first = by_ctx[min(by_ctx)]
        for ctx, b in sorted(by_ctx.items()):
            print(f"| {name} | {ctx} | {b.up:.0f} | {b.graphs:.0f} | {b.down:.0f} | {b.total:.0f} | "
                  f"{b.total / star[ctx].total:.2f} | {b.total / first.total:.2f} | {b.digest} |")  # fmt: skip


# ------------------------------------------------------------------------------ where a token's time goes


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


def print_trace_table(title: str, rows: list[tuple[str, float]]) -> None:
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
