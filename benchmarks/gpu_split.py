"""Decode speed of one model split over two GPUs, the same layer split six ways, all in one run.

On a GPU machine with no network (the lent device), after ``benchmarks/gpu_pack.sh`` made the carry folder here:

    python3 benchmarks/gpu_split.py --carry gpuc [--tokens 128] [--runs 3] [--cap 3.5] [--work /tmp/gpu-bench]
    python3 benchmarks/gpu_split.py --carry gpuc --load [--parallel 8] [--slot-ctx 9216] [--clients 1,4,8,16]
    python3 benchmarks/gpu_split.py --carry gpuc --replicas [--parallel 16] [--slot-ctx 2048] [--clients 16]
    python3 benchmarks/gpu_split.py --carry gpuc --start [--runs 3]
    python3 benchmarks/gpu_split.py --carry gpuc --pipeline [--nodes 2,3,4] [--rtt-ms 1|--netem-lo 1|--tunnel]
    python3 benchmarks/gpu_split.py --carry gpuc --pipeline --trace [--nodes 2,3,4] [--trace-clients 1,4]
    python3 benchmarks/gpu_split.py --carry gpuc --bytes [--contexts 900,7600]   (bytes through the host per token)
    python3 benchmarks/gpu_split.py --carry gpuc --embd [--runs 3]        (patch 0013's A/B; --bytes has its row too)

(--prepare builds and makes the model only, so a second call on the still-warm machine has the whole 10 minutes.)
--load: many clients at once and long prompts, every setup with the same slots and context.
--replicas: many clients on one model served by one GPU node and by two (the second a replica).
--start: a 2-node split's start → ready next to stock's own load of the same split.
--embd: the A/B of patch 0013: --load's 2-node split through the tunnel with the token embedding on the
worker and on the host (LLAMA_INPUT_ON_FIRST_RPC=0), and on the default (direct) path: 2k and 8k prefill, one stream.
--pipeline: N nodes × 1 GPU (N = --nodes), the mesh, worker to worker and the stock star with the
same split, and llama.cpp in one process on N GPUs: one stream's decode, 4 clients at once, a 2,400-token prefill.

It installs the carried wheels (into WORK/site), builds the patched binaries with mesh-llm's own build (CUDA,
self-tested) from the carried source, builds llama-quantize in the same tree, writes a random-weight F16 GGUF of the
Llama-3-8B shape (32 layers, vocabulary from the carried vocab.gguf) with ``gguf`` and quantizes it to Q4_K_M
(4.9 GB). Then, with GPU 0 for the host and GPU 1 for the worker:

  mesh-llm     two nodes (each capped at --cap GB so the plan splits), asked at the host's API: the default RPC
               path (direct TCP + TLS 1.3 where reachable), then --rpc-path tunnel (QUIC streams)
  host+TCP     llama-server on GPU 0 in-process for the host's layers, the worker's rpc-server over direct TCP
               (the mesh's topology without its tunnel)
  both RPC     both GPUs behind rpc-servers over direct TCP (the host's layers through its own rpc-server)
  in-process   llama.cpp alone on both GPUs, -sm layer
  one GPU      llama.cpp alone on GPU 0

Every row uses the mesh's plan (its --tensor-split), greedy decoding of --tokens tokens after one warm-up, and
llama-server's own decode timing; the median of --runs runs. The ratio columns divide by the in-process row and by
the host+TCP row (the same topology over plain TCP: what the mesh's own path costs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadgen import concurrent, greedy_digest, ids, one, pct, prefill, tps  # benchmarks/loadgen.py: the clients

ROOT = Path(__file__).resolve().parents[1]
SHA = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # the pinned sdist (meshllm.llama.build)
SHAPE = {"n_layer": 32, "n_embd": 4096, "n_ff": 14336, "n_head": 32, "n_head_kv": 8}  # Llama-3-8B


def prepare_python(carry: Path, work: Path) -> dict[str, str]:
    """Carried wheels into WORK/site; our src and that on sys.path (and in the children's PYTHONPATH)."""
    site = work / "site"
    if not site.is_dir():
        wheels = sorted(str(p) for p in (carry / "whl").glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *wheels], check=True)  # fmt: skip
    sys.path[:0] = [str(site), str(ROOT / "src")]
    env = dict(os.environ, PYTHONPATH=f"{site}:{ROOT / 'src'}", MESH_LLM_CACHE=str(work / "cache"))
    os.environ.update(MESH_LLM_CACHE=env["MESH_LLM_CACHE"])
    return env


def build(carry: Path, work: Path) -> tuple[object, Path]:
    """mesh-llm's own build from the carried tree; then llama-quantize in the same cmake tree."""
    from meshllm.llama import build as b
    from meshllm.llama import hardware as hw
    from meshllm.llama import source
    from meshllm.llama.selftest import build_verified

    src_root = work / "cache" / "src"
    tree = src_root / f"llama.cpp-{source.PINNED.build}"
    if not (tree / ".mesh-llm-complete").is_file():
        src_root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(carry / "llama-src.tar.xz") as tar:
            tar.extractall(src_root, filter="data")
        (tree / ".mesh-llm-complete").write_text(json.dumps({"sdist_sha256": SHA}))
    t0 = time.monotonic()
    if not hw.openssl_dev_found() and (carry / "openssl" / "include" / "openssl" / "ssl.h").is_file():
        os.environ["OPENSSL_ROOT_DIR"] = str(carry / "openssl")  # no libssl-dev here: the carried headers
    plan = b.plan_build()
    done = build_verified(plan, lambda level: b.plan_build(cpu_level=level), say=print).plan
    print(f"build: {done.backend}, {hw.describe_cpu_flags(done.cmake_flags)}, {time.monotonic() - t0:.0f} s")
    subprocess.run(["cmake", "--build", str(done.dir / "cmake"), "--target", "llama-quantize", "-j",
                    str(os.cpu_count() or 4)], check=True, capture_output=True)  # fmt: skip
    quantize = next((done.dir / "cmake").rglob("llama-quantize"))
    return done.binaries(), quantize


def random_model(vocab_file: Path, out: Path) -> None:
    """A random-weight llama GGUF (F16) of SHAPE, with the vocabulary and tokenizer of ``vocab_file``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(vocab_file)
    arch = "llama"
    w = gguf.GGUFWriter(out, arch)
    s = SHAPE
    mine = {
        f"{arch}.block_count": s["n_layer"], f"{arch}.embedding_length": s["n_embd"],
        f"{arch}.feed_forward_length": s["n_ff"], f"{arch}.attention.head_count": s["n_head"],
        f"{arch}.attention.head_count_kv": s["n_head_kv"], f"{arch}.rope.dimension_count": s["n_embd"] // s["n_head"],
        "general.file_type": 1, "general.name": "random-llama-8b-shape",
    }  # fmt: skip
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = mine.pop(key, field.contents())
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, field.types[0], sub_type=field.types[1])
        else:
            w.add_key_value(key, value, field.types[0])
    for key, value in mine.items():
        w.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 20, dtype=np.float32) * 0.02).astype(np.float16)  # tiled: speed is the point

    def mat(rows: int, cols: int) -> object:
        return np.resize(block, (rows, cols))

    e, f, kv = s["n_embd"], s["n_ff"], s["n_embd"] // s["n_head"] * s["n_head_kv"]
    w.add_tensor("token_embd.weight", mat(n_vocab, e))
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        for name, shape in [("attn_q", (e, e)), ("attn_k", (kv, e)), ("attn_v", (kv, e)), ("attn_output", (e, e)),
                            ("ffn_gate", (f, e)), ("ffn_up", (f, e)), ("ffn_down", (e, f))]:  # fmt: skip
            w.add_tensor(p + name + ".weight", mat(*shape))
        w.add_tensor(p + "attn_norm.weight", np.ones(e, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(e, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, e))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def start(run_mesh: Any, server: Any, rpc_server: Any, args: argparse.Namespace) -> None:
    """Start → ready of a 2-node split (GPU 0 host, GPU 1 worker, each capped at --cap), --runs times:
    from the second node's start to the host's "ready:" line; stock: the worker's rpc-server already up, llama-server
    on GPU 0 with the mesh's split, from its start to /health 200 (its own load of the same split)."""
    mesh_s, stock_s = [], []
    for _ in range(args.runs):
        _, st = run_mesh("start", "auto", [("0", args.cap), ("1", args.cap)], measure=lambda base, path: None)
        mesh_s.append(float(st["start_to_ready_s"]))
        counts = [a["count"] for a in st["plan"]["assignments"]]
        split = [float(c) for c in [*counts[:-1], counts[-1] + 1]]
        c, ep = rpc_server("stock-rpc", "1")
        try:
            t0 = time.monotonic()  # the moment /health answers (not the server's stop after it)
            stock_s.append(server("stock-load", "0", [ep], split, measure=lambda base, path: time.monotonic()) - t0)
        finally:
            c.stop()
        print(f"mesh {mesh_s[-1]:.1f} s, stock load {stock_s[-1]:.1f} s (split {counts})", flush=True)
    m, k = statistics.median(mesh_s), statistics.median(stock_s)
    print(f"\n| 2-node split, median of {args.runs} | seconds |\n|---|---:|")
    print(f"| mesh-llm: second node started → the host ready | {m:.1f} |")
    print(f"| stock: llama-server --rpc started → /health 200 (the load) | {k:.1f} |")
    print(f"\nmesh ÷ stock: {m / k:.2f} (goal ≤ 2)")


def pipeline(
    run_mesh: Any,
    server: Any,
    rpc_server: Any,
    free_port: Any,
    args: argparse.Namespace,
    bins: Any = None,
    model: Path | None = None,
    work: Path | None = None,
) -> None:
    """For N in --nodes, N nodes × 1 GPU (GPU 0 the host) with one even split (--tensor-split, workers
    first): the mesh (its default path: direct TLS, worker to worker where both neighbours are direct); the same
    devices without the mesh, host GPU in-process + N-1 rpc-servers over loopback TCP, worker to worker (GGML_RPC_PEERS)
    and the star (stock ggml-rpc's: every boundary through llama-server); llama.cpp in one process on N GPUs. Each:
    one stream's decode (--tokens greedy tokens), 4 clients at once (aggregate), a 2,400-token prompt's prefill; the
    median of --runs, every server with 4 slots of 3,072 tokens."""
    parallel, ctx = 4, 3072
    n_gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines())

    def measure(base: str, path: str) -> dict[str, Any]:
        one(base, path, ids(32, 1), 8)  # warm-up
        return {"txt": greedy_digest(base, path, 1500, 32, seed=5), "dec": tps(base, path, args.tokens, args.runs),
                "c4": concurrent(base, path, 4, args.tokens, args.runs, seed=11)[0],
                "pre": prefill(base, path, 2400, args.runs, seed=7)}  # fmt: skip

    table: list[tuple[int, str, dict[str, Any]]] = []
    rows = set(args.rows.split(","))
    # --netem-lo: every loopback packet waits half the RTT: every link of every row, the mesh's own too
    with netem_lo(args.netem_lo, args.carry) if args.netem_lo else contextlib.nullcontext():
        pipeline_rows(args, rows, table, measure, n_gpus, parallel, ctx, run_mesh, server, rpc_server, free_port,
                      bins, model, work)  # fmt: skip
    if args.trace:
        return
    print_pipeline(args, table, parallel, ctx, n_gpus)


def pipeline_rows(args: argparse.Namespace, rows: set[str], table: list[tuple[int, str, dict[str, Any]]],
                  measure: Any, n_gpus: int, parallel: int, ctx: int, run_mesh: Any, server: Any, rpc_server: Any,
                  free_port: Any, bins: Any, model: Any, work: Any) -> None:  # fmt: skip
    """Each N's rows of --pipeline, appended to ``table``."""
    mesh_label = "mesh-llm" + (", patch 0016 off" if os.environ.get("GGML_RPC_QUEUE_INPUTS") == "0" else "")
    for n in [int(x) for x in args.nodes.split(",")]:
        # node i on GPU i; with fewer GPUs than nodes they take turns (one stream's decode uses one stage at a time)
        gpus = [str(i % n_gpus) for i in range(n)]
        layers = [32 // n + (1 if i < 32 % n else 0) for i in range(n)]
        if args.trace:  # one token's time, command by command (benchmarks/stage_trace.py)
            from common import print_trace_table, traced_chain

            (work / f"trace{n}").mkdir(exist_ok=True)
            devices = [dict(os.environ, CUDA_VISIBLE_DEVICES=g) for g in [*gpus[1:], gpus[0]]]
            # one stream with patch 0016 on, then off; then each --trace-clients C > 1 (a step: C tokens)
            runs = [(c, off) for c in map(int, args.trace_clients.split(","))
                    for off in (((), ("GGML_RPC_QUEUE_INPUTS",)) if c == 1 else ((),))]  # fmt: skip
            for c, off in runs:
                traced = traced_chain(bins, model, n - 1, args.tokens, work / f"trace{n}", layers, devices,
                                      dict.fromkeys(off, "0"), c)  # fmt: skip
                print_trace_table(
                    f"# N={n}: {n - 1} rpc-servers worker to worker + llama-server (GPUs {','.join(gpus)}), "
                    f"layers {layers}, {args.tokens} greedy tokens{f' × {c} clients' if c > 1 else ''}"
                    f"{''.join(f', {k}=0' for k in off)}",
                    traced,
                )
            continue
        split = [float(x) for x in layers]
        split[-1] += 1  # the host's entry counts the output layer
        mesh_args = ("--parallel", str(parallel), "--ctx-size", str(ctx), "--tensor-split", ",".join(map(str, layers)))
        if args.tunnel:  # the mesh through tunnels: worker to worker through the mesh, then the star
            for path, name in (("tunnel-host", "worker to worker through the mesh"), ("tunnel", "star")):
                got, st = run_mesh(f"pipe{n}-{path}", path, [(g, None) for g in gpus], mesh_args, measure)
                via = "; ".join(x["rpc_path"] for x in st["peers"] if x.get("rpc_path"))  # type: ignore[attr-defined]
                print(f"N={n} {path}: {via}", flush=True)
                table.append((n, f"mesh-llm through tunnels, {name}", got))
        elif "mesh" in rows:
            got, st = run_mesh(f"pipe{n}", "auto", [(g, None) for g in gpus], mesh_args, measure)
            via = "; ".join(x["rpc_path"] for x in st["peers"] if x.get("rpc_path"))  # type: ignore[attr-defined]
            counts = [a["count"] for a in st["plan"]["assignments"]]  # type: ignore[index]
            print(f"N={n}: mesh plan {counts} ({via})", flush=True)
            table.append((n, f"{mesh_label}, {len(counts)} nodes on GPUs {','.join(gpus)}", got))
        if not args.tunnel and {"ring", "ring0", "ring17", "star", "star17"} & rows:  # the devices without the mesh
            peers: list[int] = []
            for _ in gpus[1:]:
                peers.append(free_port(avoid=peers))
            workers = [
                rpc_server(f"pipe{n}-w{i}", g, peer=p) for i, (g, p) in enumerate(zip(gpus[1:], peers, strict=True))
            ]
            try:
                eps = [ep for _, ep in workers]
                if args.rtt_ms:  # every link through a relay that delays it
                    from meshllm.delaytcp import DelayProxy  # a LAN's RTT on loopback

                    relays = [DelayProxy(int(ep.rsplit(":", 1)[1]), args.rtt_ms, 0) for ep in eps]
                    relays += [DelayProxy(p, args.rtt_ms, 0) for p in peers]
                    eps = [f"127.0.0.1:{r.port}" for r in relays[: len(eps)]]
                    peers = [r.port for r in relays[len(eps) :]]
                env_ = {"GGML_RPC_PEERS": ",".join(f"{ep}=127.0.0.1:{p}" for ep, p in zip(eps, peers, strict=True))}
                # the same servers under each setup: (row, label, llama-server's environment)
                variants = (
                    ("ring", "worker to worker: host GPU + RPC workers", env_),
                    ("ring0", "worker to worker, patch 0016 off", {**env_, "GGML_RPC_QUEUE_INPUTS": "0"}),
                    ("ring17", "worker to worker, patch 0017 off", {**env_, "GGML_SCHED_STAGED_COPIES": "0"}),
                    ("star", "star (every boundary through llama-server): host GPU + RPC workers", {}),
                    ("star17", "star, patch 0017 off", {"GGML_SCHED_STAGED_COPIES": "0"}),
                )
                for row, label, venv in variants:
                    if row in rows:
                        got = server(f"pipe{n}-{row}", "0", eps, split, (), measure, ctx, parallel, venv or None)
                        table.append((n, label, got))
            finally:
                for c, _ in workers:
                    c.stop()
        used = sorted(set(gpus), key=int)
        per_gpu = [sum(x for g, x in zip(gpus, split, strict=True) if g == u) for u in used]
        table.append(
            (
                n,
                f"llama.cpp in one process, {len(used)} GPUs",  # every ratio's base
                server(f"pipe{n}-inproc", ",".join(used), [], per_gpu, ("-sm", "layer"), measure, ctx, parallel),
            )
        )


def print_pipeline(args: argparse.Namespace, table: list[tuple[int, str, dict[str, Any]]], parallel: int, ctx: int,
                   n_gpus: int) -> None:  # fmt: skip
    """--pipeline's table, then the goals for N nodes against what it shows."""
    print(
        f"\n# {args.tokens} greedy tokens (one stream; 4 clients at once: aggregate), a 2,400-token prefill; "
        f"median of {args.runs}; {parallel} slots × {ctx} tokens; the same even layer split per N"
        + (f"; every RPC link {args.rtt_ms} ms RTT (delay relays)" if args.rtt_ms else "")
        + (f"; every loopback packet delayed {args.netem_lo / 2} ms (netem: {args.netem_lo} ms RTT)"
           if args.netem_lo else "")
    )
    print(
        "| N | setup | decode tok/s | ÷ in-process | ÷ star | 4 clients tok/s | ÷ in-process | prefill tok/s | "
        "÷ in-process | text |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    for n, name, r in table:
        base = next(v for m, k, v in table if m == n and k.startswith("llama.cpp in one process"))
        star = next((v for m, k, v in table if m == n and (k.endswith("star") or k.startswith("star (every"))), r)
        print(
            f"| {n} | {name} | {r['dec']:.1f} | {r['dec'] / base['dec']:.2f} | {r['dec'] / star['dec']:.2f} | "
            f"{r['c4']:.1f} | {r['c4'] / base['c4']:.2f} | {r['pre']:.0f} | {r['pre'] / base['pre']:.2f} | {r['txt']} |"
        )
    rtt = args.netem_lo or args.rtt_ms
    print(f"\n# goals for N nodes ({'at ' + str(rtt) + ' ms RTT per link' if rtt else 'loopback'}), each setup")
    for n, name, r in table:
        if name.startswith("llama.cpp in one process"):
            continue
        base = next(v for m, k, v in table if m == n and k.startswith("llama.cpp in one process"))
        where = "" if n_gpus >= n else f" — {n} nodes on {n_gpus} GPU(s): not the goals' machine (a GPU per node)"
        for what, key, goal in GOALS.get((n, bool(rtt)), ()):
            got = r[key] / base[key]
            print(f"N={n} {name}: {what} {got:.2f} of in-process, goal ≥ {goal}: {'met' if got >= goal else 'NOT met'}"
                  f"{where}")  # fmt: skip


# the goals for N nodes, ÷ llama.cpp in one process on N GPUs: (N, links delayed) -> (what, column, at least)
GOALS: dict[tuple[int, bool], tuple[tuple[str, str, float], ...]] = {
    (4, False): (("prefill 2.4k", "pre", 0.7), ("decode", "dec", 0.85), ("4 clients", "c4", 0.85)),
    (3, False): (("prefill 2.4k", "pre", 0.75),),
    (4, True): (("decode", "dec", 0.65),),
}


@contextlib.contextmanager
def netem_lo(rtt_ms: float, carry: Path) -> Iterator[None]:
    """Every packet on the loopback interface delayed rtt/2 (tc netem, as root), so every link between two processes
    on this machine has ``rtt_ms`` of round trip; taken off again however the block ends. tc: this machine's, else
    the carried one (gpu_pack.sh)."""
    tc, env = shutil.which("tc"), None
    if tc is None:
        tc, env = str(carry / "tc" / "tc"), {**os.environ, "LD_LIBRARY_PATH": str(carry / "tc")}
    add = [tc, "qdisc", "add", "dev", "lo", "root", "netem", "delay", f"{rtt_ms / 2}ms"]
    try:
        r = subprocess.run(add, capture_output=True, text=True, env=env)
    except OSError as e:
        raise SystemExit(f"--netem-lo: {tc}: {e}") from None
    if r.returncode:
        raise SystemExit(f"--netem-lo: {' '.join(add)} failed: {(r.stderr or r.stdout).strip()}")
    try:
        yield
    finally:
        subprocess.run([tc, "qdisc", "del", "dev", "lo", "root"], check=False, env=env)


def bytes_per_token(server: Any, rpc_server: Any, free_port: Any, args: argparse.Namespace) -> None:
    """What crosses llama-server's connections to two RPC workers per generated
    token after prompts of each --contexts length (the host's GPU in-process holds the last layers and the output),
    counted by a relay in front of each worker (benchmarks/host_bytes.py's ``per_token``); worker to worker's link
    goes around the relays (that is its point). The star sends every input whole (GGML_RPC_DELTA=0): stock's bytes."""
    from common import Bytes, per_token, print_bytes_table
    from loadgen import ids

    from meshllm.llama.rpcwire import CountingRelay

    split = [11.0, 11.0, 11.0]  # workers first; the host's entry counts the output layer
    contexts = [int(x) for x in args.contexts.split(",")]
    peers: list[int] = []
    for _ in range(2):
        peers.append(free_port(avoid=peers))
    n_gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines())
    workers = [rpc_server(f"bytes-w{i}", str((i + 1) % n_gpus), peer=p) for i, p in enumerate(peers)]
    relays = [CountingRelay(int(ep.rsplit(":", 1)[1])) for _, ep in workers]
    eps = [f"127.0.0.1:{r.port}" for r in relays]
    rows: list[tuple[str, dict[int, Bytes]]] = []
    ring = {"GGML_RPC_PEERS": ",".join(f"{e}=127.0.0.1:{p}" for e, p in zip(eps, peers, strict=True))}
    whole = {"GGML_RPC_DELTA": "0", "LLAMA_INPUT_ON_FIRST_RPC": "0"}
    setups = (
        ("star, every input whole (stock's bytes)", whole),
        ("worker to worker, every input whole", {**ring, **whole}),
        ("worker to worker + what changed + embedding on worker 1 (the mesh's way)",
         {**ring, "LLAMA_INPUT_ON_FIRST_RPC": "1"}),
    )  # fmt: skip
    try:
        for name, env_ in setups:

            def measure(base: str, path: str) -> dict[int, Bytes]:
                tps(base, path, 8, 1)  # warm-up
                port = int(base.rsplit(":", 1)[1])
                return {c: per_token(port, relays, ids(c, seed=3), args.tokens) for c in contexts}

            ctx = max(contexts) + args.tokens + 256
            rows.append((name, server(f"bytes-{len(rows)}", "0", eps, split, (), measure, ctx=ctx, env_=env_)))
            print(name, {c: round(b.total) for c, b in rows[-1][1].items()}, flush=True)
    finally:
        for r in relays:
            r.close()
        for c, _ in workers:
            c.stop()
    print_bytes_table(f"8B shape, 2 RPC workers (11 + 11 layers) + the host GPU (10 + output), {args.tokens} greedy "
                      "tokens, counted from the third; one run", rows)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carry", type=Path, default=ROOT / "gpuc")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-bench"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cap", type=float, default=3.5, help="GB each mesh node offers, so the 4.9 GB model splits")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="instead: the planner's memory per node vs what llama.cpp allocates (its -lv 4 breakdown)",
    )
    ap.add_argument(
        "--multi",
        action="store_true",
        help="instead: nodes with several GPUs (a 2-GPU solo node; a 2-GPU worker under a 1-GPU host)",
    )
    ap.add_argument(
        "--quad",
        action="store_true",
        help="instead (4 GPUs): a 2-GPU host and a 2-GPU worker, next to stock RPC with the same four-device split",
    )
    ap.add_argument(
        "--load",
        action="store_true",
        help="instead: many clients at once (aggregate tok/s, time to first token) and long prompts' "
        "prefill, for the mesh, stock RPC and in-process llama.cpp with the same slots and context",
    )
    ap.add_argument("--parallel", type=int, default=8, help="--load: slots of every setup (default 8)")
    ap.add_argument("--slot-ctx", type=int, default=9216, help="--load: context per slot (default 9216: an 8k prompt)")
    ap.add_argument("--clients", default="1,4,8,16", help="--load: concurrent clients, comma-separated")
    ap.add_argument("--split", default="13,19", help="--load: layers of worker and host (the issue's 13/19 split)")
    ap.add_argument(
        "--auto",
        action="store_true",
        help="instead: the mesh's default sizes (--parallel auto --ctx-size auto), alone on one GPU and "
        "split over two capped ones: what it picks, that it loads, 8 clients' aggregate",
    )
    ap.add_argument(
        "--replicas",
        action="store_true",
        help="instead: --clients at once on one mesh node (GPU 0) and on two that each hold the model "
        "(GPU 0, GPU 1: the second serves a replica), next to llama-server on one GPU and two "
        "llama-servers with the clients split between them",
    )
    ap.add_argument(
        "--start",
        action="store_true",
        help="instead: a 2-node split's start → ready (the second node's start → the host says ready), "
        "next to stock's load of the same split (llama-server --rpc: start → /health 200)",
    )
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="instead: N nodes × 1 GPU for each N of --nodes: the mesh, worker to worker (patch 0011) and "
        "the stock star with the same even split, llama.cpp in one process on N GPUs",
    )
    ap.add_argument("--nodes", default="2,3,4", help="--pipeline: node counts, comma-separated")
    ap.add_argument(
        "--rows",
        default="mesh,ring,ring0,star,inproc",
        help="--pipeline: which setups (mesh, ring: worker to worker, ring0, ring17: the same with patch 0016, 0017 "
        "off, star, star17: the star with 0017 off, inproc), comma-separated; inproc is every ratio's base",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="--pipeline: instead of the table, each N's token time command by command (stage_trace.py)",
    )
    ap.add_argument("--trace-clients", default="1", help="--trace: streams at once, comma-separated (e.g. 1,4)")
    ap.add_argument(
        "--bytes",
        action="store_true",
        help="instead: bytes through llama-server per token with 2 RPC workers, the star and worker to "
        "worker, after prompts of --contexts tokens, counted by relays in front of the workers (host_bytes.py)",
    )
    ap.add_argument("--contexts", default="900,16000", help="--bytes: prompt lengths in tokens, comma-separated")
    ap.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="--pipeline: every link between two processes (llama-server to a worker, worker to worker) "
        "through a relay that delays each way by half this (meshllm.delaytcp), as on a LAN; "
        "the mesh's nodes with MESH_LLM_NETEM=rtt=MS (its QUIC, and the same relays in front of each worker's "
        "direct-path and peer listeners)",
    )
    ap.add_argument(
        "--netem-lo",
        type=float,
        default=0.0,
        metavar="MS",
        help="--pipeline: every loopback packet delayed MS/2 (tc netem on lo, as root): every link of every row "
        "has MS of round trip, the mesh's own links too",
    )
    ap.add_argument(
        "--tunnel",
        action="store_true",
        help="--pipeline: the mesh's rows only, through tunnels (the host on --rpc-path tunnel): worker "
        "to worker through the mesh, and the star (every node on --rpc-path tunnel)",
    )
    ap.add_argument(
        "--embd",
        action="store_true",
        help="instead: patch 0013's A/B on --load's split: 2k/8k prefill and decode through the tunnel "
        "with the token embedding on the worker and on the host, and on the direct path",
    )
    ap.add_argument("--prepare", action="store_true", help="only build the binaries and make the model, then stop")
    ap.add_argument("--moe-spill", type=float, metavar="GB",
                    help="instead: one mesh node on GPU 0 with the carried tiny MoE (gpuc/tiny-moe.gguf, "
                         "tests/moe_model.py) and --max-vram GB: its plan line, llama-server's buffers (experts on "
                         "the CPU, the rest on the GPU) and its text next to llama-server alone with the same "
                         "overrides")  # fmt: skip
    ap.add_argument("--big", metavar="MODELS",
                    help="instead: models that need RAM, 'moe' (Qwen3-30B-A3B's "
                         "shape) and/or 'dense' (Llama-3-8B's), comma-separated: one node, two GPU nodes, a GPU host "
                         "and a CPU-only worker under --max-vram caps, next to llama-server's best offload and stock "
                         "RPC")  # fmt: skip
    ap.add_argument("--big-parts", default="a,b,b0,c",
                    help="--big: which: a (one node), b (two GPU nodes), b0 (and with --max-ram 0), c (a GPU host "
                         "and a CPU-only worker)")  # fmt: skip
    ap.add_argument("--big-cap-moe", type=float, default=10.0, help="--big: GB each node offers for the MoE")
    ap.add_argument("--big-cap-dense", type=float, default=3.0, help="--big: GB each node offers for the dense model")
    args = ap.parse_args()
    from common import header  # benchmarks/common.py

    header()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    env = prepare_python(args.carry.resolve(), work)
    bins, quantize = build(args.carry.resolve(), work)
    if args.moe_spill is not None:
        moe_spill(bins, args.carry.resolve() / "tiny-moe.gguf", args.moe_spill, work, env)
        return
    from meshllm.llama.processes import (
        Child,
        free_port,
        llama_server_argv,
        rpc_server_argv,
        wait_http_ready,
        wait_tcp_ready,
    )

    model = work / "m-q4.gguf"
    if args.big:  # its own models (the --big section below), written in Q4_K
        models(args.carry.resolve(), work)
    elif not model.is_file():
        t0 = time.monotonic()
        random_model(args.carry / "vocab.gguf", work / "m-f16.gguf")
        subprocess.run([str(quantize), str(work / "m-f16.gguf"), str(model), "Q4_K_M", str(os.cpu_count() or 4)],
                       check=True, capture_output=True)  # fmt: skip
        (work / "m-f16.gguf").unlink()
        print(f"model: {model.stat().st_size / 1e9:.2f} GB Q4_K_M in {time.monotonic() - t0:.0f} s")
    if args.prepare:
        return
    logs = work / "logs"
    rows: list[tuple[str, float]] = []

    def gpu(i: str) -> dict[str, str]:
        return dict(env, CUDA_VISIBLE_DEVICES=i)

    # the mesh: one node per (GPUs, --max-vram) in ``spec``; the first makes the mesh, the others join
    def run_mesh(name: str, rpc_path: str, spec: list[tuple[Any, ...]], extra: tuple[str, ...] = (),
                 measure: Any = None, everyone: bool = False, model_: Path | None = None
                 ) -> tuple[Any, dict[str, object]]:  # fmt: skip
        """``spec``: (GPUs, --max-vram or None[, that node's own flags]) per node; ``measure(base_url)``: what to
        measure at the host's API (default: single-stream decode tok/s);
        ``everyone``: once every node's llama-server serves (replicas), at the first node's API. ``rpc_path``
        "tunnel-host": the first node (the host) on --rpc-path tunnel, the others on auto (their rpc-servers keep
        the predecessor listener worker to worker through the mesh needs)."""
        nodes, ports = [], [free_port() for _ in spec]
        state = work / f"mesh-{name}"
        shutil.rmtree(state, ignore_errors=True)
        texts = [logs / f"mesh-{name}-{i}.log" for i in range(len(spec))]
        for t in texts:
            t.unlink(missing_ok=True)  # a "ready:" from an earlier run on this machine must not count
        try:
            for i, ((gpus, cap, *own), port) in enumerate(zip(spec, ports, strict=True)):
                cmd = [sys.executable, "-m", "meshllm.cli", "--model", str(model_ or model),
                       "--state-dir", str(state / f"n{i}"),
                       "--port", str(port), "--bind-host", "127.0.0.1",
                       "--rpc-path", ("auto" if i else "tunnel") if rpc_path == "tunnel-host" else rpc_path,
                       *(extra or ("--ctx-size", "2048", "--parallel", "1"))]  # fmt: skip
                cmd += ["--max-vram", str(cap)] if cap is not None else []
                cmd += list(own[0]) if own else []
                if i:
                    cmd += ["--join-file", str(state / "n0" / "token")]
                started = time.monotonic()  # the last node's start: what --start times from
                # --rtt-ms: the mesh's own links pay it too (QUIC, and relays in front of each RPC listener)
                netem = {"MESH_LLM_NETEM": f"rtt={args.rtt_ms}"} if args.rtt_ms else {}
                nodes.append(Child.start(f"n{i}", cmd, texts[i], env={**gpu(gpus), **netem}))
                while i == 0 and not (state / "n0" / "token").is_file():
                    assert nodes[0].alive(), f"the first node ended: {texts[0].read_text()[-600:]}"
                    time.sleep(0.1)
            deadline = time.monotonic() + 600
            while not (all if everyone else any)("ready:" in t.read_text() for t in texts):
                assert time.monotonic() < deadline and all(n.alive() for n in nodes), "the mesh never served"
                time.sleep(0.1)
            ready_s = time.monotonic() - started
            if everyone:
                time.sleep(3)  # the replicas' records reach the first node, its tunnels open
            host = 0 if everyone else next(i for i, t in enumerate(texts) if "ready:" in t.read_text())
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[host]}/mesh/status", timeout=30) as r:
                st = json.loads(r.read())
            st["start_to_ready_s"] = ready_s
            for t in texts:
                print(next((line for line in t.read_text().splitlines() if "capacity" in line), "?"), flush=True)
            base = f"http://127.0.0.1:{ports[host]}"
            if measure is not None:
                return measure(base, "/v1/completions"), st
            return tps(base, "/v1/completions", args.tokens, args.runs), st
        finally:
            for n in nodes:
                n.stop()

    def mesh(rpc_path: str) -> tuple[float, list[int], str]:
        """Two nodes, one GPU each."""
        v, st = run_mesh(rpc_path, rpc_path, [("0", args.cap), ("1", args.cap)])
        counts = [a["count"] for a in st["plan"]["assignments"]]  # type: ignore[index]
        path = "; ".join(p["rpc_path"] for p in st["peers"] if p.get("rpc_path"))  # type: ignore[attr-defined]
        return v, counts, path

    def server(name: str, dev: str, rpc: list[str], tensor_split: list[float], extra: tuple[str, ...] = (),
               measure: Any = None, ctx: int = 2048, parallel: int = 1,
               env_: dict[str, str] | None = None, model_: Path | None = None) -> Any:  # fmt: skip
        port = free_port()
        argv = llama_server_argv(bins, model_ or model, port, ctx_size=ctx, parallel=parallel, rpc=rpc,
                                 n_gpu_layers=999, tensor_split=tensor_split,
                                 extra=("--fit", "off", *extra))  # fmt: skip
        with Child.start(name, argv, logs / f"{name}.log", env={**gpu(dev), **(env_ or {})}) as c:
            wait_http_ready(c, f"http://127.0.0.1:{port}/health", 600)
            if measure is not None:
                return measure(f"http://127.0.0.1:{port}", "/v1/completions")
            return tps(f"http://127.0.0.1:{port}", "/completion", args.tokens, args.runs)

    def rpc_server(name: str, dev: str, device: str | None = None, peer: int = 0) -> tuple[Child, str]:
        """``peer``: its listener for a predecessor (patch 0011) on that port."""
        port = free_port(avoid=[peer])
        env_ = {"GGML_RPC_PEER_LISTEN": f"127.0.0.1:{peer}"} if peer else {}
        argv = rpc_server_argv(bins, port, device=device)
        c = Child.start(name, argv, logs / f"{name}.log", env={**gpu(dev), **env_})
        wait_tcp_ready(c, port, 60)
        return c, f"127.0.0.1:{port}"

    if args.big:
        big(run_mesh, server, rpc_server, args.carry.resolve(), work, args)
        return
    if args.quad:
        quad(run_mesh, server, rpc_server, args.tokens, args.runs)
        return
    if args.load:
        load(run_mesh, server, rpc_server, args)
        return
    if args.replicas:
        replicas(run_mesh, server, args)
        return
    if args.auto:
        auto(run_mesh, args)
        return
    if args.start:
        start(run_mesh, server, rpc_server, args)
        return
    if args.embd:
        embd(run_mesh, env, args)
        return
    if args.pipeline:
        pipeline(run_mesh, server, rpc_server, free_port, args, bins, model, work)
        return
    if args.bytes:
        bytes_per_token(server, rpc_server, free_port, args)
        return
    if args.multi:
        multi(run_mesh, server, rpc_server, args.tokens, args.runs)
        return

    def breakdown(name: str, dev: str, rpc: list[str], tensor_split: list[float]) -> str:
        """llama-server's own memory breakdown (printed as it exits, at -lv 4) for this split."""
        (logs / f"{name}.log").unlink(missing_ok=True)
        port = free_port()
        argv = llama_server_argv(bins, model, port, ctx_size=2048, rpc=rpc, n_gpu_layers=999,
                                 tensor_split=tensor_split, extra=("--fit", "off", "-lv", "4"))  # fmt: skip
        with Child.start(name, argv, logs / f"{name}.log", env=gpu(dev)) as c:
            wait_http_ready(c, f"http://127.0.0.1:{port}/health", 600)
            c.stop(timeout=30)  # SIGTERM: it prints the table on its way out
        return (logs / f"{name}.log").read_text()

    if args.calibrate:
        calibrate(run_mesh, breakdown, rpc_server, args.cap)
        return

    v, counts, path = mesh("auto")
    rows.append((f"mesh-llm: two nodes, default path ({path})", v))
    v, _, path = mesh("tunnel")
    rows.append((f"mesh-llm: two nodes, --rpc-path tunnel ({path})", v))
    split = [*counts[:-1], counts[-1] + 1]  # what the mesh hands llama.cpp: the host's entry counts the output
    ts = [float(x) for x in split]
    print(f"plan: {counts} layers (workers first, host last); --tensor-split {','.join(map(str, split))}")

    worker, worker_at = rpc_server("rpc-worker", "1")
    try:
        rows.append(("host GPU in-process + worker GPU, direct TCP RPC", server("host-tcp", "0", [worker_at], ts)))
        own, own_at = rpc_server("rpc-host", "0")
        try:
            rows.append(("both GPUs behind RPC, direct TCP", server("both-rpc", "0", [worker_at, own_at], ts)))
        finally:
            own.stop()
    finally:
        worker.stop()
    rows.append(("llama.cpp in one process, 2 GPUs, -sm layer", server("inproc", "0,1", [], ts, ("-sm", "layer"))))
    rows.append(("llama.cpp, 1 GPU", server("one-gpu", "0", [], [])))
    base = dict(rows)["llama.cpp in one process, 2 GPUs, -sm layer"]
    tcp = dict(rows)["host GPU in-process + worker GPU, direct TCP RPC"]
    print(f"\n# {args.tokens} greedy tokens, median of {args.runs}, llama-server's decode timing")
    print("| setup | tok/s | ms/token | ÷ in-process | ÷ direct TCP RPC |\n|---|---:|---:|---:|---:|")
    for name, v in rows:
        print(f"| {name} | {v:.1f} | {1000 / v:.2f} | {v / base:.2f} | {v / tcp:.2f} |")


def load(run_mesh: Any, server: Any, rpc_server: Any, args: Any) -> None:
    """Every setup with --parallel slots of --slot-ctx tokens and the same layer split (the mesh's host on GPU
    0, its worker on GPU 1; --tensor-split forces the split, as the issue's 13/19): aggregate tok/s of --tokens greedy
    tokens at each client count and the time to first token, then the prefill of a 2k and an 8k prompt. On a machine
    of one GPU every process shares GPU 0 (the mesh's paths side by side; "in one process" is llama.cpp on it)."""
    clients = [int(x) for x in args.clients.split(",")]
    n_gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines())
    second, both = ("1", "0,1") if n_gpus > 1 else ("0", "0")
    w, h = (int(x) for x in args.split.split(","))
    p, ctx = args.parallel, args.slot_ctx

    def measure(base: str, path: str) -> dict[str, object]:
        out: dict[str, object] = {}
        one(base, path, ids(32, 1), 8)  # warm-up
        for i, n in enumerate(clients):
            out[f"c{n}"] = concurrent(base, path, n, args.tokens, args.runs, seed=100 * i)
        out["p2k"] = prefill(base, path, 2000, args.runs, seed=7)
        out["p8k"] = prefill(base, path, 8000, args.runs, seed=9)  # the model was trained for 8192
        return out

    results: list[tuple[str, dict[str, object]]] = []
    mesh_args = ("--parallel", str(p), "--ctx-size", str(ctx), "--tensor-split", f"{w},{h}")
    for path_name in ("auto", "tunnel"):
        got, st = run_mesh(f"load-{path_name}", path_name, [("0", None), (second, None)], mesh_args, measure)
        via = "; ".join(x["rpc_path"] for x in st["peers"] if x.get("rpc_path"))  # type: ignore[attr-defined]
        print(
            f"mesh ({path_name}): plan {[a['count'] for a in st['plan']['assignments']]}, {via}, "  # type: ignore[index]
            f"slots {st.get('slots')}",
            flush=True,
        )
        results.append((f"mesh-llm, {'default path' if path_name == 'auto' else 'tunnel'} ({via})", got))
    ts = [float(w), float(h + 1)]
    worker, at = rpc_server("rpc-load", second)
    try:
        tcp = server("load-tcp", "0", [at], ts, (), measure, ctx, p)
        results.append(("stock: host GPU + worker over TCP RPC", tcp))
    finally:
        worker.stop()
    inproc_name = f"llama.cpp in one process, {min(n_gpus, 2)} GPU{'s' if n_gpus > 1 else ''}"
    results.append((inproc_name, server("load-inproc", both, [], ts, ("-sm", "layer"), measure, ctx, p)))
    base = dict(results)[inproc_name]
    print(
        f"\n# {args.tokens} greedy tokens per client, --parallel {p}, {ctx} tokens per slot, split {w}/{h}; "
        f"aggregate: median of {args.runs} runs; time to first token over all requests of those runs"
    )
    print("| setup | clients | aggregate tok/s | ÷ in-process | TTFT p50 s | TTFT p95 s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results:
        for n in clients:
            agg, tt = r[f"c{n}"]  # type: ignore[misc]
            b = base[f"c{n}"][0]  # type: ignore[index]
            print(f"| {name} | {n} | {agg:.1f} | {agg / b:.2f} | {pct(tt, 0.5):.3f} | {pct(tt, 0.95):.3f} |")
    print(f"\n# prefill, prompt tok/s (llama-server's prompt timing), median of {args.runs}")
    print("| setup | 2k prompt | ÷ in-process | 8k prompt | ÷ in-process |\n|---|---:|---:|---:|---:|")
    for name, r in results:
        a, b2 = r["p2k"], r["p8k"]
        print(f"| {name} | {a:.0f} | {a / base['p2k']:.2f} | {b2:.0f} | {b2 / base['p8k']:.2f} |")  # type: ignore[operator]


def embd(run_mesh: Any, env: dict[str, str], args: Any) -> None:
    """Patch 0013 A/B on --load's split (host GPU 0, worker the second GPU or GPU 0 too): the tunnel with the token
    embedding on the worker (the mesh's default where it has room), the direct path the same way, then the tunnel
    with the embedding on the host (``LLAMA_INPUT_ON_FIRST_RPC=0`` in the host's environment). Each row printed as
    it is measured."""
    n_gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines())
    second = "1" if n_gpus > 1 else "0"
    w, h = (int(x) for x in args.split.split(","))
    mesh_args = ("--parallel", str(args.parallel), "--ctx-size", str(args.slot_ctx), "--tensor-split", f"{w},{h}")

    def measure(base: str, path: str) -> dict[str, float]:
        one(base, path, ids(32, 1), 8)  # warm-up
        return {"p2k": prefill(base, path, 2000, args.runs, seed=7), "p8k": prefill(base, path, 8000, args.runs,
                seed=9), "dec": tps(base, path, args.tokens, args.runs)}  # fmt: skip

    rows: dict[str, dict[str, float]] = {}
    print("| setup | embedding | 2k prefill tok/s | 8k prefill tok/s | decode tok/s |\n|---|---|---:|---:|---:|")
    for path_name, on in (("tunnel", True), ("auto", True), ("tunnel", False)):
        if not on:
            env["LLAMA_INPUT_ON_FIRST_RPC"] = "0"
        try:
            got, st = run_mesh(f"embd-{path_name}-{on}", path_name, [("0", None), (second, None)], mesh_args, measure)
        finally:
            env.pop("LLAMA_INPUT_ON_FIRST_RPC", None)
        where = "worker" if st["plan"].get("embd_first") and on else "host"  # type: ignore[union-attr]
        rows[f"{path_name} {on}"] = got
        print(f"| {path_name} | {where} | {got['p2k']:.0f} | {got['p8k']:.0f} | {got['dec']:.1f} |", flush=True)
    d = rows.get("auto True")
    if d:
        for k in ("tunnel True", "tunnel False"):
            if k in rows:
                r = rows[k]
                print(f"{k}: tunnel ÷ direct: 2k {r['p2k'] / d['p2k']:.2f}, 8k {r['p8k'] / d['p8k']:.2f}, decode "
                      f"{r['dec'] / d['dec']:.2f}")  # fmt: skip


def replicas(run_mesh: Any, server: Any, args: Any) -> None:
    """--clients streams of --tokens greedy tokens at once, every server with --parallel slots of
    --slot-ctx tokens: one mesh node on GPU 0, then two (GPU 0 and GPU 1, each holding the whole model: the second
    serves a replica) asked at the first node's API; stock: llama-server on GPU 0, and two llama-servers (GPU 0,
    GPU 1) with the clients split between them (clients that share themselves out: the best two servers give)."""
    n, p, ctx = int(args.clients.split(",")[-1]), args.parallel, args.slot_ctx

    def measure(base: str | list[str], path: str) -> tuple[float, list[float]]:
        for b in [base] if isinstance(base, str) else base:
            one(b, path, ids(32, 1), 8)  # warm-up
        return concurrent(base, path, n, args.tokens, args.runs, seed=11)

    rows: list[tuple[str, tuple[float, list[float]]]] = []
    extra = ("--parallel", str(p), "--ctx-size", str(ctx))
    got, _ = run_mesh("rep-1", "auto", [("0", None)], extra, measure)
    rows.append(("mesh-llm, 1 node (GPU 0)", got))
    got, st = run_mesh("rep-2", "auto", [("0", None), ("1", None)], extra, measure, everyone=True)
    model = (st.get("models") or [{}])[0]  # type: ignore[index]
    print(f"two nodes: host {str(model.get('host'))[:8]}, replicas {[str(r)[:8] for r in model.get('replicas', [])]}")
    rows.append(("mesh-llm, 2 nodes: host + replica (GPU 0, GPU 1)", got))
    rows.append(("llama-server, 1 GPU", server("rep-one", "0", [], [], (), measure, ctx, p)))

    def both(base: str, path: str) -> tuple[float, list[float]]:  # a second llama-server on GPU 1 beside it
        return server("rep-two-b", "1", [], [], (), lambda b2, p2: measure([base, b2], p2), ctx, p)  # type: ignore[no-any-return]

    rows.append(("2 llama-servers (GPU 0, GPU 1), clients split between them",
                 server("rep-two-a", "0", [], [], (), both, ctx, p)))  # fmt: skip
    one_ = dict(rows)
    print(
        f"\n# {n} clients x {args.tokens} greedy tokens, every server --parallel {p} x {ctx} tokens; aggregate: "
        f"median of {args.runs} runs; TTFT over every request of those runs"
    )
    print("| setup | aggregate tok/s | ÷ its one-GPU row | TTFT p50 s | TTFT p95 s |\n|---|---:|---:|---:|---:|")
    for name, (agg, tt) in rows:
        b = one_["mesh-llm, 1 node (GPU 0)" if name.startswith("mesh") else "llama-server, 1 GPU"][0]
        print(f"| {name} | {agg:.1f} | {agg / b:.2f} | {pct(tt, 0.5):.3f} | {pct(tt, 0.95):.3f} |")


def auto(run_mesh: Any, args: Any) -> None:
    """The default sizes on a GPU: one node alone on GPU 0, then two nodes capped at --cap GB (the model splits and
    its KV must fit what is left): the slots and context each picks, and 8 clients' aggregate tok/s through it."""

    def measure(base: str, path: str) -> tuple[float, list[float]]:
        one(base, path, ids(32, 1), 8)
        return concurrent(base, path, 8, args.tokens, args.runs, seed=5)

    print("| mesh | slots x context | 8 clients tok/s | TTFT p50 s |\n|---|---:|---:|---:|")
    for name, spec in [("one node, GPU 0", [("0", None)]), (f"two nodes capped at {args.cap} GB",
                                                           [("0", args.cap), ("1", args.cap)])]:  # fmt: skip
        (agg, tt), st = run_mesh(f"auto-{len(spec)}", "auto", spec, ("--parallel", "auto"), measure)
        sl = st.get("slots") or {}
        plan = [a["count"] for a in st["plan"]["assignments"]]  # type: ignore[index]
        print(f"| {name} (plan {plan}) | {sl.get('total')} x {sl.get('ctx')} | {agg:.1f} | {pct(tt, 0.5):.3f} |",
              flush=True)  # fmt: skip


_ROW = re.compile(r"\|\s+-\s+(?P<dev>\S+)[^|]*\|[^(|]*?(?:\(\s*)?(?P<self>\d+) =\s+\d+ \+\s+\d+ \+\s+\d+")


def moe_spill(bins: Any, model: Path, cap: float, work: Path, env: dict[str, str]) -> None:
    """On a GPU: a mesh node whose --max-vram holds all but some layers' routed experts serves with those
    experts in RAM; llama-server's own buffer lines say where the bytes went; the text is llama-server's alone with
    the same overrides (-ngl 999)."""

    from meshllm.llama.processes import Child, free_port, llama_server_argv, wait_http_ready

    def ask(port: int) -> str:
        body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "seed": 1, "cache_prompt": False}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            return str(json.loads(r.read())["choices"][0]["text"])

    state, port = work / "moe-node", free_port()
    shutil.rmtree(state, ignore_errors=True)
    log = work / "moe-node.log"
    cmd = [sys.executable, "-m", "meshllm.cli", "--model", str(model), "--state-dir", str(state), "--port", str(port),
           "--bind-host", "127.0.0.1", "--max-vram", str(cap), "--max-ram", "1", "--ctx-size", "512",
           "--parallel", "1"]  # fmt: skip
    with Child.start("moe-node", cmd, log, env=dict(env, CUDA_VISIBLE_DEVICES="0")):
        deadline = time.monotonic() + 300
        while "ready:" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        text = ask(port)
        plan = next(ln for ln in log.read_text().splitlines() if "plan:" in ln)
        srv = (state / "llama-server.log").read_text()
        override = re.search(r"--override-tensor (\S+)", " ".join(srv.splitlines()[:5]))
    print(plan)
    for ln in srv.splitlines():
        if "model buffer size" in ln:
            print("mesh-llm's llama-server:", ln.split("load_tensors:")[-1].strip())
    ot = override.group(1) if override else plan
    rport = free_port()
    argv = llama_server_argv(bins, model, rport, ctx_size=512, n_gpu_layers=999,
                             extra=("--fit", "off", *(("--override-tensor", ot) if override else ())))  # fmt: skip
    with Child.start("moe-ref", argv, work / "moe-ref.log", env=dict(env, CUDA_VISIBLE_DEVICES="0")) as c:
        wait_http_ready(c, f"http://127.0.0.1:{rport}/health", 300)
        same = ask(rport) == text
    for ln in (work / "moe-ref.log").read_text().splitlines():
        if "model buffer size" in ln:
            print("llama-server alone:", ln.split("load_tensors:")[-1].strip())
    print(f"same text as llama-server alone with {ot!r}: {same}")


def parse_breakdown(log: str) -> dict[str, int]:
    """Device -> MiB llama.cpp accounts to this process there (model + context + compute), from the table
    common_memory_breakdown_print writes (b11312); "Host" is host memory (e.g. the token embeddings it keeps)."""
    out: dict[str, int] = {}
    for line in log.splitlines():
        if "memory_breakdown" in line:
            m = _ROW.search(line)
            if m:
                out[m["dev"]] = int(m["self"])
    return out


def calibrate(run_mesh: Any, breakdown: Any, rpc_server: Any, cap: float) -> None:
    """The planner's estimate per node against llama.cpp's own accounting, for the solo plan (one GPU) and the
    2-node split the mesh makes (host GPU in-process, worker GPU through RPC)."""
    mib = 1024 * 1024
    rows: list[tuple[str, float, float]] = []
    _, st = run_mesh("cal-solo", "auto", [("0", None)])
    est = st["plan"]["assignments"][0]["bytes"] / mib
    got = parse_breakdown(breakdown("cal-solo", "0", [], []))
    print(f"solo breakdown (MiB): {got}")
    rows.append(("solo, one GPU: GPU + host-mapped", est, sum(got.values())))
    _, st = run_mesh("cal-split", "auto", [("0", cap), ("1", cap)])
    plan = st["plan"]
    worker, at = rpc_server("rpc-cal", "1")
    try:
        got = parse_breakdown(breakdown("cal-split", "0", [at], [float(x) for x in plan["tensor_split"]]))
    finally:
        worker.stop()
    print(f"split plan: {plan}\nsplit breakdown (MiB): {got}")
    w, h = plan["assignments"][0], plan["assignments"][-1]
    rpc = sum(v for k, v in got.items() if k.startswith("RPC"))
    rows.append((f"split: worker ({w['count']} layers, through RPC)", w["bytes"] / mib, rpc))
    host = sum(v for k, v in got.items() if not k.startswith("RPC"))
    rows.append((f"split: host ({h['count']} layers + output, GPU + host-mapped)", h["bytes"] / mib, host))
    print("\n| node | planned MiB | llama.cpp MiB | planned ÷ allocated |\n|---|---:|---:|---:|")
    for name, e, g in rows:
        print(f"| {name} | {e:.0f} | {g:.0f} | {e / g:.3f} |" if g else f"| {name} | {e:.0f} | ? | ? |")


def multi(run_mesh: Any, server: Any, rpc_server: Any, tokens: int, runs: int) -> None:
    """Nodes with several GPUs: a solo node offers and uses both; a 2-GPU worker (capped below the 1-GPU host so the
    host is elected and the model splits) serves each GPU as a device of its own, next to stock llama.cpp RPC with
    the same three-device split and in-process llama.cpp on both GPUs."""
    rows: list[tuple[str, float]] = []
    v, st = run_mesh("solo2", "auto", [("0,1", None)])
    print(f"solo plan: {st['plan']}")
    rows.append(("mesh-llm: one node, 2 GPUs", v))
    v, st = run_mesh("worker2", "auto", [("0", 3.5), ("0,1", 3.0)])
    plan = st["plan"]
    print(f"split plan: {plan}")
    split = [float(x) for x in plan["tensor_split"]]
    rows.append((f"mesh-llm: 1-GPU host + 2-GPU worker, direct path, split {plan['tensor_split']}", v))
    worker, at = rpc_server("rpc-2gpu", "0,1", "CUDA0,CUDA1")
    try:
        rows.append(("stock RPC: the same three devices and split, direct TCP", server("stock-3dev", "0", [at], split)))
    finally:
        worker.stop()
    rows.append(("llama.cpp in one process, 2 GPUs, -sm layer", server("inproc2", "0,1", [], [], ("-sm", "layer"))))
    stock = rows[2][1]
    _versus_stock(rows, stock, tokens, runs)


def _versus_stock(rows: list[tuple[str, float]], stock: float, tokens: int, runs: int) -> None:
    print(f"\n# {tokens} greedy tokens, median of {runs}, llama-server's decode timing")
    print("| setup | tok/s | ÷ stock RPC same split |\n|---|---:|---:|")
    for name, val in rows:
        print(f"| {name} | {val:.1f} | {val / stock:.2f} |")


def quad(run_mesh: Any, server: Any, rpc_server: Any, tokens: int, runs: int) -> None:
    """Two nodes of two GPUs each (GPUs 0,1 the host's, 2,3 the worker's; the worker capped below the host so the host
    is elected and the model splits over all four), next to stock llama.cpp RPC with the same four devices and split
    (llama-server on GPUs 0,1 in-process, an rpc-server with --device CUDA0,CUDA1 on GPUs 2,3, plain TCP) and
    in-process llama.cpp on all four GPUs."""
    rows: list[tuple[str, float]] = []
    v, st = run_mesh("2x2", "auto", [("0,1", 3.5), ("2,3", 3.0)])
    plan = st["plan"]
    print(f"split plan: {plan}")
    split = [float(x) for x in plan["tensor_split"]]
    rows.append((f"mesh-llm: 2-GPU host + 2-GPU worker, direct path, tensor split {plan['tensor_split']}", v))
    worker, at = rpc_server("rpc-2gpu", "2,3", "CUDA0,CUDA1")
    try:
        rows.append(
            ("stock RPC: the same four devices and split, direct TCP", server("stock-4dev", "0,1", [at], split))
        )
    finally:
        worker.stop()
    rows.append(("llama.cpp in one process, 4 GPUs, -sm layer", server("inproc4", "0,1,2,3", [], [], ("-sm", "layer"))))
    stock = rows[1][1]
    _versus_stock(rows, stock, tokens, runs)


# ---------------------------------------------------------------------------------------------------- --big
# models that need RAM, on the lent GPU machine — ``python3 benchmarks/gpu_split.py --carry gpuc --big``.
#
# Two random-weight models written straight in Q4_K (Q4_K_M's main type; no F16 pass, no llama-quantize): the shape of
# Qwen3-30B-A3B (``qwen3moe``: 48 layers, 128 routed experts of which 8 fire, expert FFN 768, 32 heads, 4 KV heads of
# 128; 17.1 GB) and of Llama-3-8B (dense; 4.6 GB), both with the carried Llama-3 vocabulary (128,256 tokens, not
# Qwen's 151,936). Each under --max-vram caps that force RAM:
#
#   (a) one node capped at CAP: mesh-llm (its plan: the routed experts of the first layers in RAM; for the dense model
#       the first layers whole in RAM) next to llama-server alone with the best ``--n-cpu-moe`` / ``-ngl`` that uses no
#       more of the GPU than the mesh's llama-server did (nvidia-smi, per process; each candidate loaded once to see)
#   (b) two GPU nodes capped at CAP each (the model fits neither): mesh-llm (and again with ``--max-ram 0``: the
#       workers' rpc-servers then serve no CPU device) next to the best one-node offload of (a) and stock RPC with the
#       mesh's flags (host GPU in-process + an rpc-server on GPU 1, weights over the wire)
#   (c) a GPU host capped at CAP that offers no RAM (--max-ram 0) and a CPU-only worker (its RAM only: the first
#       layers whole on its CPU), next to stock RPC with the mesh's flags (host GPU in-process + a CPU rpc-server)
#
# Each row: one stream's decode (--tokens greedy tokens), 4 clients at once (aggregate), a 2,000-token prompt's prefill,
# the median of --runs; every server with 4 slots of 3,072 tokens.

MOE = {"arch": "qwen3moe", "n_layer": 48, "n_embd": 2048, "n_head": 32, "n_head_kv": 4, "head_dim": 128,
       "n_expert": 128, "n_expert_used": 8, "n_ff_exp": 768}  # fmt: skip
DENSE = {"arch": "llama", "n_layer": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128, "n_ff": 14336}
PARALLEL, SLOT_CTX = 4, 3072
THREADS = ("--threads", str(len(os.sched_getaffinity(0))))  # as mesh-llm gives its llama-server (default_threads)


def write_q4k(shape: dict[str, Any], vocab_file: Path, out: Path) -> None:
    """A random-weight GGUF of ``shape`` with every matrix in Q4_K, written block by block (speed is the point:
    the blocks repeat; each block's two f16 scales are set small, so no value is a NaN)."""
    import gguf
    import numpy as np

    arch = shape["arch"]
    reader = gguf.GGUFReader(vocab_file)
    w = gguf.GGUFWriter(out, arch)
    e, hd = shape["n_embd"], shape["head_dim"]
    keys: dict[str, Any] = {
        f"{arch}.block_count": shape["n_layer"], f"{arch}.context_length": 32768, f"{arch}.embedding_length": e,
        f"{arch}.attention.head_count": shape["n_head"], f"{arch}.attention.head_count_kv": shape["n_head_kv"],
        f"{arch}.attention.key_length": hd, f"{arch}.attention.value_length": hd, f"{arch}.rope.dimension_count": hd,
        f"{arch}.rope.freq_base": 1e6, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "general.file_type": 15, "general.name": f"random-{arch}-q4k",  # 15: mostly Q4_K_M (here: all Q4_K)
    }  # fmt: skip
    if "n_expert" in shape:
        keys |= {f"{arch}.expert_count": shape["n_expert"], f"{arch}.expert_used_count": shape["n_expert_used"],
                 f"{arch}.expert_feed_forward_length": shape["n_ff_exp"],
                 f"{arch}.feed_forward_length": shape["n_ff_exp"] * shape["n_expert_used"]}  # fmt: skip
    else:
        keys[f"{arch}.feed_forward_length"] = shape["n_ff"]
    for k, v in keys.items():
        (w.add_float32 if isinstance(v, float) else w.add_string if isinstance(v, str) else w.add_uint32)(k, v)
    for key, field in reader.fields.items():  # the tokenizer as the vocab file has it
        if key.startswith("tokenizer."):
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(key, field.contents())
            else:
                w.add_key_value(key, field.contents(), field.types[0])
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=(2_100_000, 144), dtype=np.uint8)  # 302 MB of blocks, sliced for every matrix
    scale = np.full(2, 2e-4, dtype=np.float16).view(np.uint8)
    pool[:, 0:4] = scale  # d and dmin of every block

    def q4k(*dims: int) -> Any:  # dims as numpy orders them (the last is the row); the row a multiple of 256
        rows = int(np.prod(dims[:-1]))
        n = rows * dims[-1] // 256
        assert n <= len(pool), dims
        return pool[:n].reshape(*dims[:-1], dims[-1] // 256 * 144)

    def add(name: str, data: Any) -> None:
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q4_K)

    ones = np.ones(e, dtype=np.float32)
    add("token_embd.weight", q4k(n_vocab, e))
    for i in range(shape["n_layer"]):
        b = f"blk.{i}."
        add(b + "attn_q.weight", q4k(shape["n_head"] * hd, e))
        add(b + "attn_k.weight", q4k(shape["n_head_kv"] * hd, e))
        add(b + "attn_v.weight", q4k(shape["n_head_kv"] * hd, e))
        add(b + "attn_output.weight", q4k(e, shape["n_head"] * hd))
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "ffn_norm.weight", ones)
        if "n_expert" in shape:
            x, f = shape["n_expert"], shape["n_ff_exp"]
            w.add_tensor(b + "attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(b + "attn_k_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((x, e)) * 0.05).astype(np.float32))
            add(b + "ffn_gate_exps.weight", q4k(x, f, e))
            add(b + "ffn_up_exps.weight", q4k(x, f, e))
            add(b + "ffn_down_exps.weight", q4k(x, e, f))
        else:
            f = shape["n_ff"]
            add(b + "ffn_gate.weight", q4k(f, e))
            add(b + "ffn_up.weight", q4k(f, e))
            add(b + "ffn_down.weight", q4k(e, f))
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", q4k(n_vocab, e))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def models(carry: Path, work: Path) -> dict[str, Path]:
    """Both models in WORK (made once)."""
    out = {}
    for name, shape in (("moe", MOE), ("dense", DENSE)):
        path = work / f"big-{name}-q4k.gguf"
        if not path.is_file():
            t0 = time.monotonic()
            write_q4k(shape, carry / "vocab.gguf", path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            print(f"{name}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s", flush=True)
        out[name] = path
    return out


def gpu_mib(process: str = "llama-server") -> int:
    """MiB of GPU memory the running ``process`` processes hold (nvidia-smi, per process, all GPUs)."""
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=process_name,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)  # fmt: skip
    return sum(int(m) for name, m in (ln.rsplit(",", 1) for ln in r.stdout.strip().splitlines() if "," in ln)
               if name.strip().endswith(process))  # fmt: skip


def big_measure(tokens: int, runs: int) -> Any:
    def run(base: str, path: str) -> dict[str, float]:
        one(base, path, ids(32, 1), 8)  # warm-up
        got = {"vram": float(gpu_mib()), "dec": tps(base, path, tokens, runs),
               "c4": concurrent(base, path, 4, tokens, runs, seed=11)[0],
               "pre": prefill(base, path, 2000, runs, seed=7)}  # fmt: skip
        return got

    return run


def settled(run: Any, nodes: int) -> Any:
    """``run`` once the host's plan names ``nodes`` nodes and its API answers (a mesh serves alone with RAM before
    the others join: a node short of memory no longer waits); returns (its numbers, the status then)."""

    def go(base: str, path: str) -> tuple[dict[str, float], dict[str, Any]]:
        deadline = time.monotonic() + 600
        while True:
            assert time.monotonic() < deadline, "the plan never named every node"
            with urllib.request.urlopen(base + "/mesh/status", timeout=30) as r:
                st = json.loads(r.read())
            if len((st.get("plan") or {}).get("assignments", [])) == nodes:
                try:
                    one(base, path, ids(8, 3), 2)
                    break
                except (AssertionError, urllib.error.URLError, OSError):
                    pass
            time.sleep(1)
        for _ in range(20):  # the probe may have reached the llama-server that serves alone, just before its restart
            try:
                got = run(base, path)
                with urllib.request.urlopen(base + "/mesh/status", timeout=30) as r:
                    return got, json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code != 503:
                    raise
                time.sleep(5)
        raise AssertionError("the split never served")

    return go


def flags_of(log: Path) -> tuple[list[str], list[str], list[float]]:
    """From a llama-server log's last command line: its --rpc endpoints, the flags that place memory
    (--override-tensor, --n-gpu-layers) and its --tensor-split."""
    line = log.read_text().split("\n$ ")[-1].lstrip("$ ").splitlines()[0].split()
    rpc, placing, split = [], [], []
    for i, word in enumerate(line[:-1]):
        if word == "--rpc":
            rpc = line[i + 1].split(",")
        elif word in ("--override-tensor", "--n-gpu-layers"):
            placing += [word, line[i + 1]]
        elif word == "--tensor-split":
            split = [float(x) for x in line[i + 1].split(",")]
    return rpc, placing, split


def big(run_mesh: Any, server: Any, rpc_server: Any, carry: Path, work: Path, args: Any) -> None:
    got = models(carry, work)
    run = big_measure(args.tokens, args.runs)
    sizes = ("--parallel", str(PARALLEL), "--ctx-size", str(SLOT_CTX))
    rows: list[tuple[str, str, dict[str, float], str]] = []  # (model, setup, numbers, note)

    def bench(name: str, model: Path, cap: float, n_layer: int) -> None:
        def mesh(label: str, spec: list[tuple[Any, ...]], extra: tuple[str, ...] = ()) -> dict[str, Any]:
            (r, st), _ = run_mesh(f"big-{name}-{label}", "auto", spec, (*sizes, *extra), settled(run, len(spec)),
                                  model_=model)  # fmt: skip
            p = st["plan"]
            text = "; ".join(f"{a['first']}+{a['count']}" + (f" ({len(a['experts_in_ram'])} exps in RAM)"
                                                                if a["experts_in_ram"] else "")
                             for a in p["assignments"])  # fmt: skip
            note = (f"layers 0-{p['ram_layers'] - 1} whole in RAM; " if p.get("ram_layers") else "") + text
            rows.append((name, f"mesh-llm: {label}", r, note))
            print(rows[-1], flush=True)
            logs = sorted((work / f"mesh-big-{name}-{label}").glob("n*/llama-server.log"),
                          key=lambda f: f.stat().st_mtime)  # fmt: skip
            return {"st": st, "log": logs[-1], "r": r}  # the host's (the node that ran a llama-server last)

        parts = args.big_parts.split(",")
        if "a" in parts:
            one_node(name, model, cap, n_layer, mesh)
        if "b" in parts:
            two_nodes(name, model, cap, mesh)
        if "b0" in parts:  # the workers' rpc-servers then serve no CPU device
            mesh(f"two GPU nodes capped at {cap} GB each, --max-ram 0", [("0", cap), ("1", cap)], ("--max-ram", "0"))
        if "c" in parts:  # a GPU host without RAM and a CPU-only worker: the worker's RAM holds what the GPU cannot
            c = mesh(f"GPU host capped at {cap} GB, --max-ram 0 + CPU-only worker",
                     [("0", cap, ("--max-ram", "0")), ("", None)])
            stock(name, model, c, "", "CPU")

    def one_node(name: str, model: Path, cap: float, n_layer: int, mesh: Any) -> None:
        a = mesh(f"one node capped at {cap} GB", [("0", cap)])
        if name == "moe":  # the mesh's spill as --n-cpu-moe, then fewer while llama-server alone stays in its VRAM
            k = len(a["st"]["plan"]["assignments"][-1]["experts_in_ram"])
            cands = [["--n-cpu-moe", str(n)] for n in range(max(0, k - 3), k + 1)]
        else:
            c = int(a["st"]["plan"].get("ram_layers") or 0)
            cands = [["--n-gpu-layers", str(n_layer + 1 - m)] for m in range(max(0, c - 3), c + 1)]
        best: tuple[list[str], float] | None = None
        for flags in cands:  # the least offload whose GPU memory is no more than the mesh's
            mib = server(f"big-{name}-probe", "0", [], [], (*flags, *THREADS), lambda b, p: float(gpu_mib()), SLOT_CTX,
                         PARALLEL, model_=model)  # fmt: skip
            print(f"llama-server alone {' '.join(flags)}: {mib:.0f} MiB (mesh: {a['r']['vram']:.0f})", flush=True)
            if mib <= a["r"]["vram"] * 1.01:
                best = (flags, mib)
                break
        if best is not None:
            r = server(f"big-{name}-alone", "0", [], [], (*best[0], *THREADS), run, SLOT_CTX, PARALLEL, model_=model)
            rows.append((name, f"llama-server alone, {' '.join(best[0])}", r, "best one-node offload in that VRAM"))
            print(rows[-1], flush=True)

    def two_nodes(name: str, model: Path, cap: float, mesh: Any) -> None:
        b = mesh(f"two GPU nodes capped at {cap} GB each", [("0", cap), ("1", cap)])
        eps, _, split = flags_of(b["log"])
        cpu_dev = len(split) > len(eps) + 1  # an entry for the worker's CPU: the stock worker serves it too
        stock(name, model, b, "1", "CUDA0,CPU" if cpu_dev else None)

    def stock(name: str, model: Path, b: dict[str, Any], gpus: str, device: str | None) -> None:
        """Stock RPC with the mesh's split and placing flags: the host GPU in-process, one rpc-server on ``gpus``
        serving ``device`` (weights over the wire)."""
        _, placing, split = flags_of(b["log"])
        worker, at = rpc_server(f"big-{name}-stock-w", gpus, device)
        try:
            mapped = [re.sub(r"\[[^\]]+\]$", f"[{at}]", f) for f in placing]
            r = server(f"big-{name}-stock", "0", [at], split, (*mapped, *THREADS), run, SLOT_CTX, PARALLEL,
                       model_=model)  # fmt: skip
            on = "CPU-only worker" if device == "CPU" else "GPU worker"
            rows.append((name, f"stock RPC, the mesh's split and flags ({on})", r, " ".join(mapped) or "no RAM"))
            print(rows[-1], flush=True)
        finally:
            worker.stop()

    for name in args.big.split(","):
        cap = args.big_cap_moe if name == "moe" else args.big_cap_dense
        bench(name, got[name], cap, (MOE if name == "moe" else DENSE)["n_layer"])
    print(f"\n# {args.tokens} greedy tokens (one stream; 4 clients at once: aggregate), a 2,000-token prefill; "
          f"median of {args.runs}; {PARALLEL} slots × {SLOT_CTX} tokens; GPU MiB: nvidia-smi, llama-server processes")
    print("| model | setup | GPU MiB | decode tok/s | ÷ best one node | 4 clients tok/s | ÷ | prefill tok/s | ÷ | "
          "placement |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, setup, r, note in rows:
        base = next((v for m, s, v, _ in rows if m == name and s.startswith("llama-server alone")), r)
        print(f"| {name} | {setup} | {r['vram']:.0f} | {r['dec']:.1f} | {r['dec'] / base['dec']:.2f} | "
              f"{r['c4']:.1f} | {r['c4'] / base['c4']:.2f} | {r['pre']:.0f} | {r['pre'] / base['pre']:.2f} | {note} |")
    print("\n# goals: (a) one node ≥ 0.95 of the best one-node offload; (b) two nodes ≥ 1.5× it and ≥ 1.0 of stock RPC")
    for name in args.big.split(","):
        mine = {s: v for m, s, v, _ in rows if m == name}
        alone = next((v for s, v in mine.items() if s.startswith("llama-server alone")), None)
        one_ = next((v for s, v in mine.items() if "one node" in s), None)
        two = next((v for s, v in mine.items() if "two GPU nodes" in s), None)
        b_stock = mine.get("stock RPC, the mesh's split and flags (GPU worker)")
        c = next((v for s, v in mine.items() if "CPU-only worker" in s and s.startswith("mesh-llm")), None)
        c_stock = mine.get("stock RPC, the mesh's split and flags (CPU-only worker)")
        for k in ("dec", "c4", "pre"):
            got = [f"(a) {one_[k] / alone[k]:.2f}" if one_ and alone else "(a) -"]
            got += [f"(b) {two[k] / alone[k]:.2f}× one node" if two and alone else "(b) -"]
            got += [f"(b) ÷ stock {two[k] / b_stock[k]:.2f}"] if two and b_stock else []
            got += [f"(c) ÷ stock {c[k] / c_stock[k]:.2f}"] if c and c_stock else []
            print(f"{name} {k}: {'; '.join(got)}")


if __name__ == "__main__":
    main()
