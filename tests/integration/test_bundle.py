"""A bundle made here installs and serves where there is no compiler and no package index."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import psutil

from meshllm.llama.processes import free_port

# What a plain machine has on its PATH: a shell, coreutils, grep, and Python. No cmake, no compiler, no git.
TOOLS = ("sh", "dirname", "uname", "grep", "ls", "head", "mkdir", "cp", "cat", "rm", "env")
NEVER = ("cmake", "cc", "c++", "gcc", "g++", "clang", "git", "ninja", "make")


def plain_path(where: Path) -> str:
    where.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (where / tool).symlink_to(found)
    (where / "python3").symlink_to(Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}")
    path = str(where)
    assert not [t for t in NEVER if shutil.which(t, path=path)]
    return path


def test_a_bundle_installs_and_serves_without_compiler_or_index(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "mesh-llm-bundle.tar.gz"
    r = subprocess.run(
        [sys.executable, "-m", "meshllm.cli", "bundle", str(out), "--python", "3.11"],
        capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (tmp_path / "unpacked").mkdir()
    # unpacked as the README says a user does (`tar xzf`): tarfile's data filter is missing from Debian 12's 3.11.2
    r = subprocess.run(["tar", "xzf", str(out), "-C", str(tmp_path / "unpacked")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with tarfile.open(out) as tar:  # nothing in it lands outside its folder
        assert all(m.name.split("/")[0] == "mesh-llm-bundle" and ".." not in m.name.split("/") for m in tar)
    top = tmp_path / "unpacked" / "mesh-llm-bundle"
    manifest = json.loads((top / "manifest.json").read_text())
    assert manifest["cpu_level"] in ("portable", "generic")  # never a -march=native or AMX build
    assert "AMX" not in manifest["cpu_extensions"]
    assert any(w.startswith("mesh_llm-") for w in manifest["wheels"])

    env = {
        "PATH": plain_path(tmp_path / "plainbin"),
        "HOME": str(tmp_path / "home"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens there: any index access fails
        "MESH_LLM_CACHE": str(tmp_path / "empty-cache"),  # no cached build to fall back on
        "LANG": "C.UTF-8",
    }
    dest = tmp_path / "installed"
    r = subprocess.run(["sh", str(top / "install.sh"), str(dest)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{dest}/bin/mesh-llm --model MODEL.gguf --join TOKEN" in r.stdout

    port = free_port()
    log_path = tmp_path / "node.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(dest / "bin" / "mesh-llm"), "--model", str(tiny_model), "--state-dir", str(tmp_path / "state"),
             "--bind-host", "127.0.0.1", "--port", str(port), "--ctx-size", "512"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        t0 = time.monotonic()
        while "ready:" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() - t0 < 180, log_path.read_text()
            time.sleep(0.2)
        servers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "llama-server"]
        assert servers and all(p.exe().startswith(str(dest / "share" / "mesh-llm" / "bin")) for p in servers)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())
        assert reply["choices"][0]["message"]["content"].strip()
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
