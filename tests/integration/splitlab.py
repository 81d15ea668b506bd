"""Start a real split on loopback: rpc-servers, each behind a counting relay, and a llama-server using them."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshllm.llama.build import Binaries
from meshllm.llama.processes import (
    Child,
    free_port,
    llama_server_argv,
    rpc_server_argv,
    wait_http_ready,
    wait_tcp_ready,
)
from meshllm.llama.rpcwire import CountingRelay, WireStats

PROMPT = "Here is a short story about a lighthouse keeper:"


@dataclass
class Worker:
    bins: Binaries
    gguf: Path | None = None  # --gguf (patched rpc-server only)
    peer_port: int | None = None  # patch 0011: its listener for its predecessor (GGML_RPC_PEER_LISTEN)


@dataclass
class Split:
    llama: Child
    port: int
    relays: list[CountingRelay]
    workers: list[Child]
    load: list[WireStats]  # what crossed each relay while the model loaded

    def complete(self, prompt: str = PROMPT, n: int = 64) -> str:
        body = json.dumps(
            {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 1, "cache_prompt": False}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        assert out["tokens_predicted"] == n, out
        text: str = out["content"]
        return text

    def rchar(self) -> int:
        """Bytes llama-server has read through read()-like calls (page-cache hits included)."""
        for line in Path(f"/proc/{self.llama.pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise AssertionError("no rchar in /proc/PID/io")


def start_split(
    tmp: Path,
    client: Binaries,
    workers: list[Worker],
    model: Path,
    children: list[Child],
    relays: list[CountingRelay],
    env: dict[str, str] | None = None,
    threads: int = 1,
    tensor_split: list[float] | None = None,
    extra: list[str] | None = None,
    counted: bool = True,
) -> Split:
    """``counted``: each rpc-server behind a CountingRelay (Python, in this process) so tests can see the wire;
    benchmarks that time the split pass False, and llama-server reaches the rpc-servers straight over TCP."""
    procs: list[Child] = []
    mine: list[CountingRelay] = []
    ports: list[int] = []
    for i, w in enumerate(workers):
        port = free_port(avoid=[w.peer_port] if w.peer_port else [])
        wenv = {**os.environ, "GGML_RPC_PEER_LISTEN": f"127.0.0.1:{w.peer_port}"} if w.peer_port else None
        argv = rpc_server_argv(w.bins, port, threads=threads, gguf=w.gguf)
        child = Child.start(f"rpc{i}", argv, tmp / f"rpc{i}.log", env=wenv)
        children.append(child)
        wait_tcp_ready(child, port)
        procs.append(child)
        if not counted:
            ports.append(port)
            continue
        relay = CountingRelay(port)
        relays.append(relay)
        mine.append(relay)
        ports.append(relay.port)
    before = [r.snapshot() for r in mine]
    # patch 0011: llama-server learns each worker's peer listener (by the endpoint it reaches that worker at)
    pairs = zip(ports, workers, strict=True)
    peers = ",".join(f"127.0.0.1:{p}=127.0.0.1:{w.peer_port}" for p, w in pairs if w.peer_port)
    if peers:
        env = {**(env or {}), "GGML_RPC_PEERS": peers}
    port = free_port()
    argv = llama_server_argv(
        client,
        model,
        port,
        ctx_size=1024,
        threads=2,
        rpc=[f"127.0.0.1:{p}" for p in ports],
        n_gpu_layers=99,
        tensor_split=tensor_split or (),
        # read() instead of mmap: what the host reads shows in rchar
        extra=["--load-mode", "none", *(extra or [])],
    )
    llama = Child.start("llama-server", argv, tmp / "llama.log", env={**os.environ, **(env or {})})
    children.append(llama)
    wait_http_ready(llama, f"http://127.0.0.1:{port}/health", timeout=180)
    load = [r.snapshot().minus(b) for r, b in zip(mine, before, strict=True)]
    return Split(llama=llama, port=port, relays=mine, workers=procs, load=load)


def stop_split(s: Split) -> None:
    s.llama.stop()
    for w in s.workers:
        w.stop()
    for r in s.relays:
        r.close()


def stock_split_text(tmp: Path, stock: Binaries, model: Path, counts: list[float], n: int,
                     extra: Sequence[str] = ()) -> str:  # fmt: skip
    """Greedy text of the same layer split loaded the stock way: stock binaries, one rpc-server per device
    (the last one plays the host's own), weights pushed over the wire; ``extra``: llama-server's flags beside."""
    children: list[Child] = []
    relays: list[CountingRelay] = []
    ref = start_split(tmp, stock, [Worker(stock) for _ in counts], model, children, relays, threads=2,
                      tensor_split=counts, extra=["--fit", "off", *extra])  # fmt: skip
    try:
        return ref.complete(PROMPT, n)
    finally:
        stop_split(ref)
        for ch in children:
            ch.stop()
