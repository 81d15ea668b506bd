"""[big] 5: models that need RAM, on the lent GPU machine — ``python3 benchmarks/gpu_split.py --carry gpuc --big``.

Two random-weight models written straight in Q4_K (Q4_K_M's main type; no F16 pass, no llama-quantize): the shape of
Qwen3-30B-A3B (``qwen3moe``: 48 layers, 128 routed experts of which 8 fire, expert FFN 768, 32 heads, 4 KV heads of
128; 17.1 GB) and of Llama-3-8B (dense; 4.6 GB), both with the carried Llama-3 vocabulary (128,256 tokens, not
Qwen's 151,936). Each under --max-vram caps that force RAM:

  (a) one node capped at CAP: mesh-llm (its plan: the routed experts of the first layers in RAM; for the dense model
      the first layers whole in RAM) next to llama-server alone with the best ``--n-cpu-moe`` / ``-ngl`` that uses no
      more of the GPU than the mesh's llama-server did (nvidia-smi, per process; each candidate loaded once to see)
  (b) two GPU nodes capped at CAP each (the model fits neither): mesh-llm (and again with ``--max-ram 0``: the
      workers' rpc-servers then serve no CPU device) next to the best one-node offload of (a) and stock RPC with the
      mesh's flags (host GPU in-process + an rpc-server on GPU 1, weights over the wire)
  (c) a GPU host capped at CAP that offers no RAM (--max-ram 0) and a CPU-only worker (its RAM only: the first
      layers whole on its CPU), next to stock RPC with the mesh's flags (host GPU in-process + a CPU rpc-server)

Each row: one stream's decode (--tokens greedy tokens), 4 clients at once (aggregate), a 2,000-token prompt's prefill,
the median of --runs; every server with 4 slots of 3,072 tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadgen import concurrent, ids, one, prefill  # benchmarks/loadgen.py: the clients

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


def measure(tokens: int, runs: int) -> Any:
    from gpu_split import tps

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
    run = measure(args.tokens, args.runs)
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
    print(f"\n# [big] {args.tokens} greedy tokens (one stream; 4 clients at once: aggregate), a 2,000-token prefill; "
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
