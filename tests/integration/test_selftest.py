"""A build proves itself before it is cached, and a crashing llama-server is reported in one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from meshllm.llama import build as b
from meshllm.llama import hardware as hw
from meshllm.llama import supervisor
from meshllm.llama.build import Binaries
from meshllm.llama.rpcwire import hello
from meshllm.llama.selftest import build_verified, self_test

# A stand-in for the llama.cpp tree: real cmake, real processes, but its "binaries" are small Python programs, so a
# crash on the first generation (what llama.cpp's AMX kernels do on an AMX CPU) can be had on any machine. Built
# without an rpath (mesh-llm's native CPU level) its llama-server dies with SIGSEGV when asked to generate.
STANDIN_CMAKE = """cmake_minimum_required(VERSION 3.16)
project(standin NONE)
if("${CMAKE_BUILD_RPATH}" STREQUAL "")
  set(SERVER server_crash.py)
else()
  set(SERVER server_ok.py)
endif()
add_custom_target(ggml-rpc-server ALL
  COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_SOURCE_DIR}/rpc.py ${CMAKE_BINARY_DIR}/bin/ggml-rpc-server)
add_custom_target(llama-server ALL
  COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_SOURCE_DIR}/${SERVER} ${CMAKE_BINARY_DIR}/bin/llama-server)
"""

STANDIN_RPC = """
import socket, struct, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
srv = socket.create_server(("127.0.0.1", port))
while True:
    conn, _ = srv.accept()
    with conn:
        data = b""
        while len(data) < 33:
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
        if len(data) == 33 and data[0] == 14:  # HELLO
            conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0]) + bytes(25))
"""

STANDIN_SERVER = """
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
CRASH = {crash}
class H(BaseHTTPRequestHandler):
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if CRASH:
            os.kill(os.getpid(), signal.SIGSEGV)
        self._send({{"content": " Paris", "tokens_predicted": 4, "timings": {{"predicted_per_second": 50.0}}}})
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


def standin_tree(root: Path) -> Path:
    (root / "ggml").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text(STANDIN_CMAKE)
    for name, text in [
        ("rpc.py", STANDIN_RPC),
        ("server_crash.py", STANDIN_SERVER.format(crash=True)),
        ("server_ok.py", STANDIN_SERVER.format(crash=False)),
    ]:
        (root / name).write_text(f"#!{sys.executable}\n{text}")
        (root / name).chmod(0o755)
    return root


def test_a_build_that_crashes_in_its_self_test_is_not_cached_and_is_retried_with_safer_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESH_LLM_CACHE", str(tmp_path / "cache"))
    src = standin_tree(tmp_path / "llama.cpp")

    def replan(level: str | None) -> b.BuildPlan:
        return b.plan_build(stock=True, llama_src=src, backend="cpu", cpu_level=level)

    said: list[str] = []
    result = build_verified(replan(None), replan, say=said.append, jobs=1)
    native = replan("native")
    assert result.plan.cpu_level == hw.safer_level("native", hw.cpu_flags()) != "native"
    assert result.built and result.plan.is_built()
    # the crash: reported in one line that says what crashed and doing what, then the retry and its flags
    failed = [m for m in said if m.startswith("self-test failed")]
    assert len(failed) == 1 and "\n" not in failed[0], said
    assert "llama-server crashed (SIGSEGV) generating 4 tokens of the tiny model" in failed[0]
    assert f"retrying once with safer ones ({result.plan.cpu_level}: " in failed[0]
    assert any(m.startswith("self-test passed") for m in said)
    # the crashing build is not cached, and later lookups go straight to the safer one
    assert not native.is_built() and not (native.dir / "cmake").exists()
    assert "SIGSEGV" in json.loads(native.failed_marker.read_text())["problem"]
    assert replan(None).dir == result.plan.dir
    assert build_verified(replan(None), replan, say=said.append).built is False


def test_real_binaries_pass_the_self_test(patched_bins: Binaries, tiny_model: Path, tmp_path: Path) -> None:
    problem, summary = self_test(patched_bins, logs=tmp_path, model=tiny_model)
    assert problem is None, problem
    assert "generated 4 tokens" in summary and "HELLO ok" in summary


async def test_a_crash_loop_is_one_line_with_its_cause(
    patched_bins: Binaries, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.05,))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(4096))  # the magic, then nothing a loader can use
    cfg = supervisor.ServerConfig(model=bad, alias="bad", ctx_size=256, threads=1)
    server = supervisor.LocalServer(patched_bins, cfg, tmp_path)
    server.start()
    for _ in range(600):
        if server.state == "failed":
            break
        await asyncio.sleep(0.1)
    await server.stop()
    assert server.reason.startswith(f"llama-server exited (exit code 1) {supervisor.MAX_CRASHES} times in a minute")
    assert "could not load the model" in server.reason and "\n" not in server.reason
    assert server.restarts == supervisor.MAX_CRASHES - 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "meshllm.supervisor"]
    assert all("\n" not in w for w in warnings) and len(warnings) == supervisor.MAX_CRASHES


async def test_a_dead_rpc_server_comes_back_on_its_port(
    patched_bins: Binaries, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.05,))
    rpc = supervisor.RpcServer(patched_bins, tiny_model, tmp_path)
    rpc.start()
    try:
        await rpc.wait_ready()
        assert rpc.child is not None
        port, pid = rpc.port, rpc.child.pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(300):
            if rpc.alive() and rpc.child is not None and rpc.child.pid != pid:
                break
            await asyncio.sleep(0.1)
        assert rpc.alive() and rpc.port == port and rpc.restarts == 1
        assert (await asyncio.to_thread(hello, port))[0] == 7
    finally:
        await rpc.stop()
    assert rpc.child is None and rpc.state == "stopped"
