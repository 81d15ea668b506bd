"""The built llama.cpp binaries: cached, they start, they answer (frame issue)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from meshllm.llama.build import Binaries, plan_build
from meshllm.llama.processes import (
    Child,
    free_port,
    http_get_json,
    llama_server_argv,
    rpc_server_argv,
    wait_http_ready,
    wait_tcp_ready,
)
from meshllm.llama.rpcwire import hello


@pytest.mark.parametrize("stock", [False, True], ids=["patched", "stock"])
def test_second_build_is_a_noop(stock: bool) -> None:
    plan = plan_build(stock=stock)
    assert plan.is_built(), "run mesh-llm build first"
    before = {p: p.stat().st_mtime_ns for p in (plan.manifest, plan.bin_dir / "llama-server")}
    cmd = [sys.executable, "-m", "meshllm.cli", "build"] + (["--stock"] if stock else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in before} == before
    manifest = json.loads(plan.manifest.read_text())
    assert manifest["flavour"] == ("stock" if stock else "patched")
    assert manifest["key"] == plan.key


@pytest.mark.parametrize("which", ["patched", "stock"])
def test_rpc_server_answers_hello(
    which: str, patched_bins: Binaries, stock_bins: Binaries, children: list[Child], tmp_path: Path
) -> None:
    bins = patched_bins if which == "patched" else stock_bins
    port = free_port()
    child = Child.start(f"rpc-{which}", rpc_server_argv(bins, port, threads=1), tmp_path / "rpc.log")
    children.append(child)
    wait_tcp_ready(child, port)
    assert hello(port) == (7, 0, 0)
    # it serves one client at a time and goes on to the next
    assert hello(port)[0] == 7
    assert child.alive()


def _complete(port: int, prompt: str, n: int) -> dict[str, object]:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 42, "cache_prompt": False}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def test_solo_llama_server_health_and_greedy_completion(
    patched_bins: Binaries, tiny_model: Path, children: list[Child], tmp_path: Path
) -> None:
    port = free_port()
    argv = llama_server_argv(patched_bins, tiny_model, port, ctx_size=1024, threads=os.cpu_count() or 2)
    child = Child.start("llama-server", argv, tmp_path / "llama.log")
    children.append(child)
    wait_http_ready(child, f"http://127.0.0.1:{port}/health", timeout=120)
    status, body = http_get_json(f"http://127.0.0.1:{port}/health")
    assert status == 200 and isinstance(body, dict) and body.get("status") == "ok"

    prompt = "The capital of France is"
    a = _complete(port, prompt, 16)
    b = _complete(port, prompt, 16)
    assert a["content"] == b["content"], "greedy decoding must be deterministic"
    assert isinstance(a["content"], str) and a["content"].strip()
    assert a["tokens_predicted"] == 16
    # the 270M base model answers " the capital of the country of France. It is the largest city in France."
    # here; gibberish from a broken build or model would not mention France
    assert "France" in a["content"]
