"""A build proves itself before it is cached as good.

After compiling, the new ggml-rpc-server must answer an RPC HELLO and the new llama-server must generate a few
tokens of the tiny model. A binary that crashes there (an upstream kernel that dies on this CPU, say) is reported
in one line, its build is marked failed on this machine, and the build is made once more with safer CPU flags
(see ``build.safer_level``) instead of caching binaries that die at every start.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from meshllm.errors import BuildError, MeshError
from meshllm.llama import build as b
from meshllm.llama import hardware as hw
from meshllm.llama.processes import (
    Child,
    ChildFailed,
    describe_exit,
    free_port,
    llama_server_argv,
    rpc_server_argv,
    wait_http_ready,
    wait_tcp_ready,
)
from meshllm.llama.rpcwire import hello

SELF_TEST_TOKENS = 4


def _tiny_model() -> Path | None:
    """The tiny model, or None when its package is not installed (the self-test then checks HELLO only)."""
    from meshllm.models.tiny import tiny_model_path

    try:
        return tiny_model_path()
    except MeshError:
        return None


def _crash(child: Child, doing: str) -> str:
    return f"{child.name} crashed ({describe_exit(child.proc.returncode)}) {doing}"


def check_rpc_server(bins: b.Binaries, logs: Path) -> str | None:
    port = free_port()
    with Child.start("ggml-rpc-server", rpc_server_argv(bins, port, threads=1), logs / "rpc-server.log") as child:
        try:
            wait_tcp_ready(child, port, timeout=30.0)
            major, minor, patch = hello(port)
        except ChildFailed:
            return _crash(child, "at start") if not child.alive() else f"{child.name} did not listen in 30 s"
        except (OSError, ValueError) as e:
            if not child.alive():
                return _crash(child, "answering an RPC HELLO")
            return f"{child.name} gave no valid HELLO reply: {e}"
        time.sleep(0.2)  # a crash just after replying counts too
        if not child.alive():
            return _crash(child, "after an RPC HELLO")
    return None if major > 0 else f"{child.name} answered HELLO with version {major}.{minor}.{patch}"


def check_llama_server(bins: b.Binaries, model: Path, logs: Path) -> tuple[str | None, float]:
    """(problem or None, tokens per second of the short generation)."""
    port = free_port()
    threads = max(1, os.cpu_count() or 1)
    argv = llama_server_argv(bins, model, port, ctx_size=512, threads=threads)
    with Child.start("llama-server", argv, logs / "llama-server.log") as child:
        try:
            wait_http_ready(child, f"http://127.0.0.1:{port}/health", timeout=300.0)
        except ChildFailed:
            return (_crash(child, "loading the tiny model") if not child.alive() else "llama-server never got ready"), 0
        body = json.dumps({"prompt": "The capital of France is", "n_predict": SELF_TEST_TOKENS, "temperature": 0})
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                out = json.loads(r.read())
        except (OSError, ValueError) as e:
            time.sleep(0.5)  # let a dying server finish dying, so the crash is what we report
            if not child.alive():
                return _crash(child, f"generating {SELF_TEST_TOKENS} tokens of the tiny model"), 0
            return f"llama-server failed to generate: {e}", 0
        n = int(out.get("tokens_predicted", 0))
        tps = float(out.get("timings", {}).get("predicted_per_second", 0.0))
        if n < 1:
            return f"llama-server generated no tokens: {str(out)[:200]}", 0
        if not child.alive():
            return _crash(child, "after generating"), 0
    return None, tps


def self_test(bins: b.Binaries, logs: Path | None = None, model: Path | None = None) -> tuple[str | None, str]:
    """Run the built binaries once. Returns (the problem in one line or None, a summary of what was checked)."""
    with tempfile.TemporaryDirectory(prefix="mesh-llm-selftest-") as tmp:
        where = logs or Path(tmp)
        problem = check_rpc_server(bins, where)
        if problem:
            return problem, ""
        model = model or _tiny_model()
        if model is None:
            return None, "rpc-server HELLO ok; generation not checked (the tiny model is not installed)"
        problem, tps = check_llama_server(bins, model, where)
        return problem, f"rpc-server HELLO ok; llama-server generated {SELF_TEST_TOKENS} tokens ({tps:.0f} tok/s)"


def build_verified(
    plan: b.BuildPlan,
    replan: Callable[[str], b.BuildPlan],
    *,
    say: Callable[[str], None] = print,
    jobs: int | None = None,
    progress: b.ProgressFn = lambda step, done, total: None,
) -> b.BuildResult:
    """Build ``plan`` (or find it cached); a fresh build must pass :func:`self_test` before it is cached. When
    it fails, retry once at the next safer CPU level (``replan(level)`` gives that plan)."""

    def verify(bins: b.Binaries, logs: Path) -> str | None:
        say("self-test: the new binaries answer an RPC HELLO and generate a few tokens")
        logs.mkdir(parents=True, exist_ok=True)
        problem, summary = self_test(bins, logs=logs)
        if not problem:
            say(f"self-test passed: {summary}")
        return problem

    try:
        return b.build(plan, jobs=jobs, say=say, progress=progress, verify=verify)
    except b.SelfTestFailed as e:
        level = hw.safer_level(plan.cpu_level, hw.cpu_flags())
        if level is None:
            raise BuildError(f"{e}; no safer CPU flags left to try (logs: {e.logs})") from None
        safer = replan(level)
        say(
            f"self-test failed: {e} with CPU flags [{hw.describe_cpu_flags(plan.cmake_flags)}]; retrying once with "
            f"safer ones ({level}: {hw.describe_cpu_flags(safer.cmake_flags)})"
        )
        try:
            return b.build(safer, jobs=jobs, say=say, progress=progress, verify=verify)
        except b.SelfTestFailed as e2:
            raise BuildError(f"the {level} build failed its self-test too: {e2} (logs: {e2.logs})") from None
