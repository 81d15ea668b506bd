"""Solo: one node serves the test model on its API port, through llama-server on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from meshllm.llama.processes import free_port


def _post(port: int, path: str, body: dict[str, object], key: str | None = None) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _get(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Solo:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.state = tmp / "node"
        self.log_path = tmp / "node.log"
        self.log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "meshllm.cli", "--model", "gemma3-270m", "--state-dir", str(self.state),
               "--bind-host", "127.0.0.1", "--port", str(self.port), "--ctx-size", "1024", *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120) -> None:
        t0 = time.monotonic()
        while "ready:" not in self.log_path.read_text(errors="replace"):
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() - t0 < timeout, self.log_path.read_text()
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture
def solo(tmp_path: Path) -> Iterator[Solo]:
    s = Solo(tmp_path)
    yield s
    s.stop()


def _readme_examples() -> list[tuple[str, dict[str, object], str]]:
    """The README's curl examples under "## Serving": (path, JSON body, the answer text its comment shows)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = text.split("## Serving", 1)[1].split("```bash", 1)[1].split("```", 1)[0].splitlines()
    out: list[tuple[str, dict[str, object], str]] = []
    for i, line in enumerate(lines):
        if line.startswith("curl "):
            path = re.search(r":9337(/v1/\S+)", line).group(1)  # type: ignore[union-attr]
            body = json.loads(re.search(r"-d '(.*)'", lines[i + 1]).group(1))  # type: ignore[union-attr]
            shown = re.search(r'"(?:content|text)":("(?:[^"\\]|\\.)*")', lines[i + 2]).group(1)  # type: ignore[union-attr]
            out.append((path, body, json.loads(shown)))
    return out


def _llama_server_port(pid: int) -> int:
    for child in psutil.Process(pid).children(recursive=True):
        if "llama-server" in child.name():
            for c in child.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    assert c.laddr.ip == "127.0.0.1", "llama-server must listen on loopback only"
                    return int(c.laddr.port)
    raise AssertionError("no llama-server child listening")


def test_solo_answers_like_llama_server_itself(solo: Solo) -> None:
    solo.wait_ready()
    status, models = _get(solo.port, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["gemma3-270m"]  # type: ignore[index]
    assert _get(solo.port, "/health")[0] == 200
    body = {"model": "gemma3-270m", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    code, via_mesh = _post(solo.port, "/v1/completions", body)
    assert code == 200, via_mesh
    direct_port = _llama_server_port(solo.proc.pid)
    code, direct = _post(direct_port, "/v1/completions", body, (solo.state / "llama-server.key").read_text().strip())
    assert via_mesh["choices"][0]["text"] == direct["choices"][0]["text"]  # type: ignore[index]
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    code, out = _post(solo.port, "/v1/chat/completions", chat)
    assert code == 200 and out["choices"][0]["message"]["content"]  # type: ignore[index]
    # the README's first examples print what the README shows: its chat (no max_tokens) answers and
    # stops, though the tiny model is a base model; its completion prints the text shown
    examples = _readme_examples()
    assert [path for path, _, _ in examples] == ["/v1/chat/completions", "/v1/completions"], examples
    for path, req, shown in examples:
        code, out = _post(solo.port, path, req)
        choice = out["choices"][0]  # type: ignore[index]
        got = choice["message"]["content"] if "message" in choice else choice["text"]
        assert code == 200 and got == shown, (path, out)
        if "message" in choice:
            assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] < 16, out  # type: ignore[index]
    # /v1/responses of a base model (a transcript template, no turn tokens) ends at the turn too (before,
    # it ran to its cap: " Hello.\nUser: Hello.\nAssistant: Hello.\n…")
    code, out = _post(solo.port, "/v1/responses", {"input": "Say hello.", "max_output_tokens": 60, "temperature": 0})
    said = out["output"][0]["content"][0]["text"]  # type: ignore[index]
    assert code == 200 and said.strip() and "User:" not in said and out["usage"]["output_tokens"] < 20, out  # type: ignore[index]
    # one model served: another name reaches it too (as with llama-server), and the answer names the real one
    code, out = _post(solo.port, "/v1/completions", {**body, "model": "no-such-model"})
    assert code == 200 and out["model"] == "gemma3-270m", out
    status, st = _get(solo.port, "/mesh/status")
    assert status == 200 and st["role"] == "host"

    # what the OpenAI SDK reads: model objects (retrieve too), errors with a string code and the field at fault
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{solo.port}/v1", api_key="unused")
    m = client.models.retrieve("gemma3-270m")
    assert m.id == "gemma3-270m" and m.created > 0 and m.owned_by == "mesh-llm"
    with pytest.raises(openai.NotFoundError) as nf:
        client.models.retrieve("no-such-model")
    assert nf.value.code == "model_not_found"
    assert client.completions.create(model="gpt-4o-mini", prompt="x", max_tokens=1).model == "gemma3-270m"
    code, err = _post(solo.port, "/v1/completions", {"model": "gemma3-270m", "max_tokens": 1})  # no prompt
    assert code == 400 and err["error"]["param"] == "prompt", err  # type: ignore[index]
    assert "json.exception" not in json.dumps(err)  # not llama-server's JSON library talking
    with pytest.raises(openai.BadRequestError) as ns:  # a model that makes text: no embeddings
        client.embeddings.create(model="gemma3-270m", input="hello")
    assert ns.value.code == "model_not_supported" and "--embeddings" not in str(ns.value), ns.value


def test_streaming_arrives_token_by_token(solo: Solo) -> None:
    solo.wait_ready()
    req = urllib.request.Request(
        f"http://127.0.0.1:{solo.port}/v1/chat/completions",
        data=json.dumps(
            {
                "messages": [{"role": "user", "content": "Explain how a car engine works."}],
                "max_tokens": 16,
                "temperature": 0,
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:  # read as it arrives: each event is timed when it reaches us
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append((time.monotonic(), json.loads(line[6:])))
    content = [t for t, e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert len(content) >= 8, "expected one event per token"
    # token by token, not buffered: the first token reached us well before the last (a proxy that buffers the
    # whole reply delivers every event within a few milliseconds of the end)
    assert content[-1] - content[0] >= 0.25 * (content[-1] - t0), (content[0] - t0, content[-1] - t0)
    # more tokens than a slot holds (max_tokens 10,000,000 was taken as asked): as many as it holds, and a
    # header says how many (a stop string ends this one at once)
    st = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{solo.port}/mesh/status", timeout=10).read())
    big = {"prompt": "Once upon a time", "max_tokens": 10_000_000, "stop": [" "], "temperature": 0}
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{solo.port}/v1/completions",
                                data=json.dumps(big).encode(), headers={"Content-Type": "application/json"}),
                                timeout=60) as r:  # fmt: skip
        assert r.status == 200 and r.headers["X-Mesh-Max-Tokens"] == str(st["slots"]["ctx"]), (dict(r.headers), st)


def test_listen_all_requires_the_api_key(tmp_path: Path) -> None:
    s = Solo(tmp_path, "--listen-all", "--api-key", "sekrit-123")
    try:
        s.wait_ready()
        body = {"prompt": "Hi", "max_tokens": 2}
        assert _post(s.port, "/v1/completions", body)[0] == 401
        assert _post(s.port, "/v1/completions", body, key="wrong")[0] == 401
        assert _post(s.port, "/v1/completions", body, key="sekrit-123")[0] == 200
        assert "sekrit-123" not in s.log_path.read_text()
    finally:
        s.stop()


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "meshllm.cli", "--state-dir", str(tmp_path / "s"), *args],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    r = run("--model", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "no such file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    r = run("--model", str(junk))
    assert r.returncode == 2 and "not a GGUF file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run("--model", "gemma3-270m", "--port", str(busy.getsockname()[1]))
    assert r.returncode == 2 and "in use" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        r = run("--model", "gemma3-270m", "--rpc-port", str(busy.getsockname()[1]))
    assert r.returncode == 2 and "--rpc-port" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with socket.socket() as busy:  # the console's port, before the node founds a mesh (no token written)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run("--model", "gemma3-270m", "--console", str(busy.getsockname()[1]))
    assert r.returncode == 2 and "--console" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "s" / "token").exists()
    with _port_with_next_taken() as taken:  # PORT+1 (the links between workers) taken, PORT itself free
        r = run("--model", "gemma3-270m", "--rpc-port", str(taken - 1))
    assert r.returncode == 2 and f"port {taken} is in use" in r.stderr, r.stderr


@contextlib.contextmanager
def _port_with_next_taken() -> Iterator[int]:
    """Holds a listening port whose predecessor was free a moment ago (an ephemeral port's neighbour may belong to
    another process: CI once found it taken)."""
    for _ in range(50):
        with socket.socket() as busy:
            busy.bind(("0.0.0.0", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            with socket.socket() as probe:
                try:
                    probe.bind(("0.0.0.0", taken - 1))
                except OSError:
                    continue
            yield taken
            return
    raise AssertionError("no port with a free predecessor in 50 tries")


def test_sigterm_leaves_no_children_and_the_same_command_starts_again_at_once(tmp_path: Path) -> None:
    """A second node on a running node's state dir is refused with one line naming its pid; after
    Ctrl-C the same command starts again at once (the API port's connections in TIME-WAIT do not count as in use)."""
    s = Solo(tmp_path)
    s.wait_ready()
    kids = psutil.Process(s.proc.pid).children(recursive=True)
    assert kids
    argv = [sys.executable, "-m", "meshllm.cli", "--model", "gemma3-270m", "--state-dir", str(s.state), "--port",
            str(s.port)]  # the same command twice: the state dir is what it names, not the port  # fmt: skip
    second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and f"another mesh-llm (pid {s.proc.pid}) runs on state dir" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    def status_text() -> str:
        r = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--state-dir", str(s.state)],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
        return r.stdout + r.stderr

    assert "stopped" not in status_text()
    kept = socket.create_connection(("127.0.0.1", s.port))  # a keep-alive client: the server closes it as it stops
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert b"HTTP/1.1" in kept.recv(4096)
    s.stop()
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    kept.close()
    assert "stopped: no node runs on" in status_text()  # a stopped node was shown as live
    again = Solo(tmp_path, "--port", str(s.port))  # the same state dir and port, at once
    try:
        again.wait_ready()
    finally:
        again.stop()


def test_killed_mesh_llm_takes_its_children_along(tmp_path: Path) -> None:
    s = Solo(tmp_path)
    s.wait_ready()
    kids = psutil.Process(s.proc.pid).children(recursive=True)
    s.proc.kill()  # SIGKILL to mesh-llm only: its llama-server must not outlive it
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive
    s.stop()


def test_self_draft_runs_on_the_host_and_a_foreign_vocabulary_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    s = Solo(tmp_path, "--draft", str(tiny_model), "--draft-max", "4")  # the tiny model can draft for itself
    try:
        s.wait_ready()
        code, out = _post(s.port, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 16, "temperature": 0})
        assert code == 200 and out["choices"][0]["text"]  # type: ignore[index]
        log = (s.state / "llama-server.log").read_text()
        assert "--spec-draft-model" in log and "--spec-draft-device none" in log  # on this host's own CPU
        assert "loading draft model" in log
        assert "pi --provider mesh --model gemma3-270m" in s.log_path.read_text()
        assert _get(s.port, "/mesh/status")[1]["draft"] == tiny_model.name
    finally:
        s.stop()
    from meshllm.llama.source import fetch_pinned_source

    other = fetch_pinned_source() / "models" / "ggml-vocab-llama-bpe.gguf"  # a vocabulary-only GGUF (Llama 3)
    r = subprocess.run(
        [sys.executable, "-m", "meshllm.cli", "--model", "gemma3-270m", "--draft", str(other),
         "--state-dir", str(tmp_path / "s2"), "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "vocabulary differs" in r.stderr and len(r.stderr.strip().splitlines()) == 1
