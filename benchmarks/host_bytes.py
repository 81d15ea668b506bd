"""Bytes through the host per generated token, with two RPC workers, as the context grows.

    .venv/bin/python benchmarks/host_bytes.py [--contexts 900,16000] [--tokens 32]

The tiny model split over three rpc-servers on loopback (rpc0, rpc1: the workers; the last plays the host's own
device and keeps the output), llama-server in front, a counting relay (meshllm.llama.rpcwire.CountingRelay) in front
of each worker: what crosses llama-server's connections to the two workers while it generates, per token, after a
prompt of each --contexts length (random token ids, no prompt cache). Setups:

- stock star: stock binaries (every boundary through llama-server, every input whole, weights pushed);
- worker to worker (0011), every input whole (``GGML_RPC_DELTA=0``);
- the mesh's way: worker to worker, inputs as what changed (0014), the token embedding on the first worker (0013).

``--mesh``: the same through mesh-llm itself, 3 nodes on this machine (the tiny model, ``--tensor-split 6,6,7``), the
host on ``--rpc-path tunnel`` so both workers are reached through QUIC tunnels: worker to worker through the mesh
(the workers on the default path keep their peer listeners) against the star (every node on ``--rpc-path tunnel``),
counted by the host's own ``mesh_llm_tunnel_bytes_{sent,received}_total{kind="rpc"}`` (what its tunnels carried,
before QUIC's framing), both with the mesh's defaults (inputs as what changed, the embedding on the first worker).

Counted from the third streamed token on (the prompt's graphs are sent by then); "graphs" is whole graphs sent again
(GRAPH_COMPUTE: a new shape, once per 256 cells of context), shown apart and left out of the total. gpu_split.py --bytes
uses the same counting (``common.per_token``) for the 8B shape on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.client
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Bytes, per_token, print_bytes_table  # benchmarks/common.py


def tunnel_rpc_bytes(port: int) -> tuple[int, int]:
    """(sent, received) RPC bytes through every tunnel of the node whose API is on ``port`` (its /metrics)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    got = {"sent": 0, "received": 0}
    for m in re.finditer(r'(?m)^mesh_llm_tunnel_bytes_(sent|received)_total\{[^}]*kind="rpc"[^}]*\} (\d+)', text):
        got[m.group(1)] += int(m.group(2))
    return got["sent"], got["received"]


def mesh_per_token(port: int, prompt: list[int], n: int) -> Bytes:
    """Stream ``n`` greedy tokens after ``prompt`` (token ids) from the node's API; what its tunnels carried as RPC
    from the third token to the last, per token (sent: "up", received: "down"; graphs are not told apart here)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    c.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()[:300]
    before, text, seen = (0, 0), "", 0
    for line in r:
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            text += choices[0].get("text") or ""
            seen += 1
            if seen == 2:
                before = tunnel_rpc_bytes(port)
    c.close()
    after, k = tunnel_rpc_bytes(port), seen - 2
    assert k > 0, f"{seen} chunks streamed"
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return Bytes((after[0] - before[0]) / k, 0.0, (after[1] - before[1]) / k, digest)


def mesh_rows(contexts: list[int], tokens: int, model: Path, tmp: Path) -> list[tuple[str, dict[int, Bytes]]]:
    """--mesh: the star and worker to worker through the mesh's tunnels, 3 nodes (module docstring)."""
    from loadgen import ids
    from tests.integration.meshlab import NodeProc, wait_for

    ctx = max(contexts) + tokens + 256
    common = ("--ctx-size", str(ctx), "--parallel", "1", "--tensor-split", "6,6,7")
    rows: list[tuple[str, dict[int, Bytes]]] = []
    for name, workers_path in (("mesh, star (every node on the tunnel path)", "tunnel"),
                               ("mesh, worker to worker through the mesh", "auto")):  # fmt: skip
        a = NodeProc(tmp, f"a-{workers_path}", model, "--max-vram", "3", *common, "--rpc-path", "tunnel")
        nodes = [a]
        try:
            token_file = a.state / "token"
            wait_for(token_file.exists, 60, "the host's token")
            for w in "bc":
                nodes.append(NodeProc(tmp, f"{w}-{workers_path}", model, "--max-vram", "2", *common, "--join",
                                      token_file.read_text().strip(), "--rpc-path", workers_path))  # fmt: skip
            wait_for(functools.partial(_split_over, a, 3), 300, "a 3-way split")
            print(name, [str(p.get("rpc_path")) for p in _peers(a) if p.get("rpc_path")], flush=True)
            mesh_per_token(a.port, ids(32, seed=1), 4)  # warm-up
            rows.append((name, {c: mesh_per_token(a.port, ids(c, seed=3), tokens) for c in contexts}))
            print(name, {c: round(b.total) for c, b in rows[-1][1].items()}, flush=True)
        finally:
            for nd in nodes:
                nd.stop()
    return rows


def _split_over(node: Any, n: int) -> bool:
    """Whether ``node`` (a NodeProc) is a ready host whose plan splits over ``n`` nodes."""
    plan = node.status().get("plan")
    return "ready:" in node.text() and isinstance(plan, dict) and len(plan.get("assignments", [])) == n


def _peers(node: Any) -> list[dict[str, Any]]:
    peers = node.status().get("peers")
    return list(peers) if isinstance(peers, list) else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="900,16000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--mesh", action="store_true", help="instead: through mesh-llm's tunnels, 3 nodes (see above)")
    args = ap.parse_args()
    from common import header  # benchmarks/common.py
    from loadgen import ids  # benchmarks/loadgen.py
    from tests.integration.splitlab import Worker, start_split, stop_split

    from meshllm.llama.build import find_binaries
    from meshllm.llama.processes import Child, free_port
    from meshllm.models.tiny import tiny_model_path

    header()
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.mesh:
        with tempfile.TemporaryDirectory(prefix="mesh-llm-bytes-") as tmpd:
            through = mesh_rows(contexts, args.tokens, tiny_model_path(), Path(tmpd))
        print_bytes_table(f"tiny model, mesh-llm: 3 nodes (6 + 6 + 7 layers), the host reaching both workers "
                          f"through tunnels, {args.tokens} greedy tokens, counted from the third; one run",
                          through)  # fmt: skip
        return 0
    from meshllm.llama.rpcwire import CountingRelay

    model, stock, patched = tiny_model_path(), find_binaries(stock=True), find_binaries()
    ctx = max(contexts) + args.tokens + 256
    setups: list[tuple[str, Any, bool, dict[str, str]]] = [
        ("stock star", stock, False, {}),
        ("worker to worker, every input whole", patched, True,
         {"GGML_RPC_DELTA": "0", "LLAMA_INPUT_ON_FIRST_RPC": "0"}),
        ("worker to worker + what changed + embedding on worker 1 (the mesh's way)", patched, True,
         {"LLAMA_INPUT_ON_FIRST_RPC": "1"}),
    ]  # fmt: skip
    rows: list[tuple[str, dict[int, Bytes]]] = []
    with tempfile.TemporaryDirectory(prefix="mesh-llm-bytes-") as tmpd:
        for i, (name, bins, peers, env) in enumerate(setups):
            ports = [free_port(), free_port()] if peers else [None, None]
            gguf = model if bins is patched else None
            workers = [Worker(bins, gguf=gguf, peer_port=ports[0]), Worker(bins, gguf=gguf, peer_port=ports[1]),
                       Worker(bins, gguf=gguf)]  # fmt: skip
            children: list[Child] = []
            relays: list[CountingRelay] = []
            s = start_split(Path(tmpd) / str(i), bins, workers, model, children, relays, env=env, threads=2,
                            tensor_split=[6.0, 6.0, 7.0],
                            extra=["--fit", "off", "--ctx-size", str(ctx), "--parallel", "1"])  # fmt: skip
            try:
                rows.append((name, {c: per_token(s.port, s.relays[:2], ids(c, seed=3), args.tokens) for c in contexts}))
                print(name, {c: round(b.total) for c, b in rows[-1][1].items()}, flush=True)
            finally:
                stop_split(s)
                for ch in children:
                    ch.stop()
    print_bytes_table(f"tiny model, 2 workers (6 + 6 layers) + a last device (7 + output), {args.tokens} greedy "
                      "tokens, counted from the third; one run", rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
