"""A mixture-of-experts model on the mesh, on CPU — the tiny random-weight ``qwen3moe`` of
``tests/moe_model.py`` (8 routed experts, 2 active) split over two real nodes: the greedy text equals the same split
loaded by stock binaries, and the worker loads its layers' expert tensors from its own copy of the file (nothing of
them crosses the wire); a node, and a mesh, short of memory keep routed experts and whole layers in RAM and answer as
the same placement loaded by stock binaries. And the plan preview's memory per node against what a split allocates."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshllm.llama.build import Binaries
from meshllm.llama.gguf import read_header
from meshllm.proto.spill import experts_override
from meshllm.serve.fetch.modelfiles import model_shape
from tests.moe_model import tiny_moe_path

from .meshlab import NodeProc, serves, split_pair, wait_for
from .splitlab import Worker, start_split, stock_split_text, stop_split
from .test_fetch_layers import N, _ask, _assignments


@pytest.fixture(scope="module")
def tiny_moe() -> Path:
    return tiny_moe_path()


def test_the_tiny_moe_is_a_real_moe(tiny_moe: Path) -> None:
    names = {t.name for t in read_header(tiny_moe).tensors}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight", "blk.3.ffn_down_exps.weight"} <= names
    assert 3e6 < tiny_moe.stat().st_size < 10e6


def test_a_moe_split_over_two_nodes_answers_as_stock_rpc_and_loads_experts_locally(
    tmp_path: Path, tiny_moe: Path, stock_bins: Binaries
) -> None:
    nodes: list[NodeProc] = []
    try:
        a = NodeProc(tmp_path, "a", tiny_moe, "--tensor-split", "1,1", "--ctx-size", "512", "--rpc-path", "tunnel")
        nodes.append(a)
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        b = NodeProc(tmp_path, "b", tiny_moe, "--ctx-size", "512", "--max-vram", "1",  # less memory: a hosts
                     "--join", (a.state / "token").read_text().strip())  # fmt: skip
        nodes.append(b)
        wait_for(lambda: serves(a, 2), 120, "a to serve a split with b")
        text = _ask(a.port)
        counts = [float(x["count"]) for x in _assignments(a)]  # type: ignore[arg-type]
        assert counts == [2.0, 2.0], counts
        assert stock_split_text(tmp_path / "ref", stock_bins, tiny_moe, counts, N) == text
        b_id = b.status()["node"]
        peer = next(p for p in a.status()["peers"] if p["node"] == b_id)  # type: ignore[attr-defined]
        assert peer["tunnel"]["rpc_local_loads"] > 0 and peer["tunnel"]["load_weight_bytes"] <= 64 << 10, peer
        # the plan preview of the running mesh names both nodes and loads nothing
        argv = ["plan", str(tiny_moe), "--state-dir", str(a.state), "--ctx-size", "512", "--parallel", "1"]
        r = subprocess.run([sys.executable, "-m", "meshllm.cli", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "on the mesh as node" in r.stdout and "2 nodes that may serve" in r.stdout, r
        assert r.stdout.count(" offered)") == 2 and "slots: 1 × 512 tokens" in r.stdout, r.stdout
    finally:
        for n in nodes:
            n.stop()


def test_a_node_short_of_accelerator_memory_keeps_experts_in_ram_and_serves(
    tmp_path: Path, tiny_moe: Path, stock_bins: Binaries
) -> None:
    """On one node: ``--max-vram`` too small for the tiny MoE (35.13 MB planned at this context) and RAM
    offered beside it: before, the node waited ("need 0.04 GB, have 0.04 GB"); now it serves with the routed experts
    of its first layers in RAM (llama-server gets the tensor overrides, as ``--n-cpu-moe`` would), and answers as
    llama-server alone with the same overrides."""
    from meshllm.llama.processes import Child, free_port, llama_server_argv, wait_http_ready
    from meshllm.proto.spill import experts_override

    a = NodeProc(tmp_path, "a", tiny_moe, "--max-vram", "0.034856", "--max-ram", "0.5", "--ctx-size", "512",
                 "--parallel", "1")  # fmt: skip
    ref: Child | None = None
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        assert "layers 0-1: attention here, experts in RAM (0.00 GB)" in a.text(), a.text()[-2000:]
        override = experts_override((0, 1))
        assert override in (a.state / "llama-server.log").read_text() or override in _cmdline_of_children(a)
        text = _ask(a.port)
        port = free_port()
        argv = llama_server_argv(stock_bins, tiny_moe, port, ctx_size=512, threads=2,
                                 extra=["--override-tensor", override])  # fmt: skip
        ref = Child.start("ref", argv, tmp_path / "ref.log")
        wait_http_ready(ref, f"http://127.0.0.1:{port}/health")
        assert _ask(port) == text
    finally:
        if ref is not None:
            ref.stop()
        a.stop()


def _cmdline_of_children(n: NodeProc) -> str:
    import psutil

    return "\n".join(" ".join(c.cmdline()) for c in psutil.Process(n.proc.pid).children(recursive=True))


def test_a_mesh_short_of_accelerator_memory_keeps_whole_layers_and_experts_in_ram_and_answers_as_stock(
    tmp_path: Path, tiny_moe: Path, stock_bins: Binaries
) -> None:
    """Two nodes whose offered memory (``--max-vram``) holds one layer each of the tiny MoE with its routed
    experts in RAM: the plan keeps the first two layers whole in the host's RAM (llama-server's --n-gpu-layers) and
    the experts of the others in RAM (the host's by a tensor override; the CPU worker's one device is its RAM). It
    serves instead of waiting, and answers as the same placement loaded by stock binaries. The host's llama-server
    puts each class of weights where the plan says."""
    nodes: list[NodeProc] = []
    try:  # the host: its buffers (33.97 MB at this context) and 0.15 MB; the worker: its buffer and 0.15 MB
        a = NodeProc(tmp_path, "a", tiny_moe, "--max-vram", "0.034116", "--max-ram", "0.5", "--ctx-size", "512",
                     "--parallel", "1", "--rpc-path", "tunnel")  # fmt: skip
        nodes.append(a)
        # a serves alone first (layers 0-2 whole in RAM): the split with b is a re-plan, and the status shows the
        # split served only once the old llama-server has gone (before, a request then met the one being replaced)
        wait_for(lambda: serves(a, 1), 120, "a to serve alone")
        b = NodeProc(tmp_path, "b", tiny_moe, "--max-vram", "0.02387", "--max-ram", "0.5", "--ctx-size", "512",
                     "--join", (a.state / "token").read_text().strip())  # fmt: skip
        nodes.append(b)
        wait_for(lambda: serves(a, 2), 120, "a to serve a split with b")
        plan = a.status()["plan"]
        assert isinstance(plan, dict)
        assert (plan["ram_layers"], plan["n_gpu_layers"], plan["tensor_split"]) == (2, 3, [1, 2]), plan
        worker, host = _assignments(a)
        assert (worker["first"], worker["experts_in_ram"], host["experts_in_ram"]) == (2, [2], [3]), plan
        assert "layers 0-1 whole in RAM" in a.text(), a.text()[-2000:]
        text = _ask(a.port)
        flags = ["--n-gpu-layers", "3", "--override-tensor", experts_override((3,))]
        ours = (a.state / "llama-server.log").read_text().split("\n$ ")[-1].splitlines()[0]  # its last command line
        assert " --n-gpu-layers 3 " in ours and ours.count("--n-gpu-layers") == 1 and flags[-1] in ours, ours
        ref = tmp_path / "ref"
        assert stock_split_text(ref, stock_bins, tiny_moe, [1.0, 2.0], N, [*flags, "-lv", "4"]) == text
        # where this placement puts the weights (the reference's buffer lines, -lv 4): the worker's device its
        # layer 2 whole (a CPU worker's experts in RAM are on its one device), the host's device layer 3's attention
        # and the output, the host's CPU the embedding, layers 0-1 whole and layer 3's routed experts
        log = (ref / "llama.log").read_text()
        buffers = [float(m) * 2**20 for m in re.findall(r"load_tensors: +\S+ model buffer size = +([\d.]+) MiB", log)]
        shape = model_shape(read_header(tiny_moe))
        want = [shape.embd_bytes + sum(shape.layer_bytes[:2]) + shape.experts(3), shape.layer_bytes[2],
                shape.layer_bytes[3] - shape.experts(3) + shape.output_bytes + shape.other_bytes]  # fmt: skip
        pairs = zip(sorted(buffers), sorted(want), strict=True)  # (the log's order is not the devices')
        assert len(buffers) == 3 and all(abs(g - w) <= 0.02 * w + 8192 for g, w in pairs), (buffers, want)
    finally:
        for n in nodes:
            n.stop()


def _allocated(log: str, endpoints: list[str]) -> list[float]:
    """Bytes llama-server's log (-lv 4) says each RPC device (in ``endpoints`` order) allocated — model, KV cache and
    compute buffers — with its own CPU's (model, output, KV, compute) added to the last, the host's own."""
    got = [0.0] * len(endpoints)
    line = r"^\S+ I \w+: +(\S+) +(?:model|KV|compute|output) buffer size = +([\d.]+) MiB"
    for dev, mib in re.findall(line, log, re.M):
        m = re.fullmatch(r"RPC\d+\[(.+)\]", dev)
        got[endpoints.index(m.group(1)) if m else -1] += float(mib) * 2**20
    return got


def test_the_plan_preview_names_the_memory_each_node_of_a_split_allocates(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries
) -> None:
    """``mesh-llm plan`` prints, per node, what the planner charges (weights, KV cache, compute and output
    buffers); the same placement loaded with llama-server's buffer lines on (-lv 4: the mesh's own runs print none)
    allocates that within 10 % on each node — the worker's rpc-server, the host's rpc-server and llama-server's CPU.
    (The tiny MoE is no test of it: its 5.7 MB are less than the fixed part of a compute buffer.)"""
    from meshllm.llama.processes import Child
    from meshllm.llama.rpcwire import CountingRelay

    nodes: list[NodeProc] = []
    try:
        a, _ = split_pair(tmp_path, tiny_model, nodes)
        planned = [int(x["bytes"]) for x in _assignments(a)]  # type: ignore[call-overload]
        argv = ["plan", str(tiny_model), "--state-dir", str(a.state), "--ctx-size", "1024", "--parallel", "1"]
        r = subprocess.run([sys.executable, "-m", "meshllm.cli", *argv], capture_output=True, text=True, timeout=60)
        shown = [float(g) * 1e9 for g in re.findall(r"([\d.]+) GB planned", r.stdout)]
        assert len(shown) == 2 and all(abs(s - p) <= 0.006e9 for s, p in zip(shown, planned, strict=True)), r.stdout
        cmd = (a.state / "llama-server.log").read_text().split("\n$ ")[-1].splitlines()[0]
        counts = [float(x) for x in cmd.split("--tensor-split ")[1].split()[0].split(",")]
    finally:
        for n in nodes:
            n.stop()
    children: list[Child] = []
    relays: list[CountingRelay] = []
    ref = start_split(tmp_path / "ref", patched_bins, [Worker(patched_bins) for _ in counts], tiny_model, children,
                      relays, threads=2, tensor_split=counts, counted=False, env={"LLAMA_INPUT_ON_FIRST_RPC": "1"},
                      extra=["--fit", "off", "-lv", "4", "--flash-attn", "auto"])  # fmt: skip
    try:
        log = (tmp_path / "ref" / "llama.log").read_text()
        endpoints = cmd.split("--rpc ")[1].split()[0].split(",")
        ref_endpoints = log.split("--rpc ")[1].split()[0].split(",")
        assert len(endpoints) == len(ref_endpoints) == 2, cmd
        got = _allocated(log, ref_endpoints)
        assert "token embedding on" in log and all(g > 0 for g in got), log[-3000:]
        ratios = [p / g for p, g in zip(planned, got, strict=True)]
        print(f"planned {planned}, allocated {[int(g) for g in got]}: {[f'{x:.3f}' for x in ratios]}")
        assert all(0.9 <= x <= 1.1 for x in ratios), (planned, got)
    finally:
        stop_split(ref)
        for ch in children:
            ch.stop()
