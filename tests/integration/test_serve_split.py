"""Three model nodes sized so the plan splits three ways, plus a lite client: the same answers from every
node's :9337, with no weights and no logits on the wire."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from meshllm.llama.build import Binaries
from meshllm.llama.gguf import read_header
from meshllm.sockets import host_port

from .meshlab import NodeProc, children, serves, wait_for
from .splitlab import PROMPT, stock_split_text

N = 64


def complete(port: int, path: str = "/completion", key: str | None = None, **extra: object) -> dict[str, object]:
    """A greedy completion; ``key``: llama-server's own, to ask it directly."""
    body = {"prompt": PROMPT, "n_predict": N, "max_tokens": N, "temperature": 0, "seed": 1, "cache_prompt": False}
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps({**body, **extra}).encode(),
        headers={"Content-Type": "application/json", **auth},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def text_of(out: dict[str, object]) -> str:
    if "content" in out:
        return str(out["content"])
    return str(out["choices"][0]["text"])  # type: ignore[index]


def llama_server_port(node: NodeProc) -> int:
    for p in children(node.proc):
        if "llama-server" in p.name():
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    return int(c.laddr.port)
    raise AssertionError("no llama-server")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, NodeProc]]:
    tmp = tmp_path_factory.mktemp("split-mesh")
    # the tunnel path (--rpc-path tunnel): its byte counts are what proves no weights and no logits cross
    a = NodeProc(tmp, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024", "--rpc-path", "tunnel")
    nodes = {"a": a}
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        token = (a.state / "token").read_text().strip()
        for name in "bd":  # workers with room for some of the layers each
            nodes[name] = NodeProc(tmp, name, tiny_model, "--max-vram", "0.07", "--ctx-size", "1024", "--join", token)
        nodes["c"] = NodeProc(tmp, "c", None, env={"MESH_LLM_JOIN": token})  # the lite client
        wait_for(lambda: serves(a, 3), 120, "the host to serve a 3-way split")
        for n in nodes.values():
            wait_for(lambda n=n: _health(n.port) == 200, 60, f"{n.state.name}'s :{n.port} to answer")
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()


def _assignments(n: NodeProc) -> list[dict[str, object]]:
    p = n.status().get("plan")
    return list(p.get("assignments", [])) if isinstance(p, dict) else []


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return int(r.status)
    except OSError:
        return 0


def test_plan_splits_and_every_node_gives_the_hosts_answer(
    mesh: dict[str, NodeProc], stock_bins: Binaries, tiny_model: Path, tmp_path: Path
) -> None:
    a = mesh["a"]
    plan = a.status()["plan"]
    assert isinstance(plan, dict) and len(plan["assignments"]) == 3, plan
    # the host started llama-server once its workers had elected it: none refused it, it never failed
    assert "llama-server exited" not in a.text(), a.text()[-3000:]
    assert not any("not the elected host" in mesh[n].text() for n in "bd"), [mesh[n].text()[-2000:] for n in "bd"]
    workers = [x for x in plan["assignments"][:-1]]
    counts = [x["count"] for x in plan["assignments"]]
    # the host's own llama-server, asked directly
    direct = text_of(complete(llama_server_port(a), key=(a.state / "llama-server.key").read_text().strip()))
    for n in mesh.values():
        assert text_of(complete(n.port, "/v1/completions")) == direct, f"{n.state.name} differs"
    # the same split loaded the stock way (stock binaries, weights pushed, same layer counts)
    assert stock_split_text(tmp_path, stock_bins, tiny_model, [float(x) for x in counts], N) == direct

    # per worker: no weights on the wire, only a hidden state back per token (logits would be 1 MiB), and the
    # plan's memory estimate within 15% of what llama-server allocated there
    def tunnel(hexid: str) -> dict[str, int]:
        return next(p for p in a.status()["peers"] if p["node"] == hexid)["tunnel"]  # type: ignore[attr-defined, index, no-any-return]

    before = {w["node"]: tunnel(str(w["node"]))["rpc_received"] for w in workers}
    complete(mesh["c"].port, "/v1/completions")
    for w in workers:
        tun = tunnel(str(w["node"]))
        assert tun["rpc_local_loads"] > 0 and tun["load_weight_bytes"] <= 1_000_000, tun
        per_token = (tun["rpc_received"] - before[w["node"]]) / N
        est, got = int(w["bytes"]), tun["load_allocated"]  # type: ignore[call-overload]
        print(f"worker {str(w['node'])[:8]}: {w['count']} layers, {tun['load_weight_bytes']} weight bytes, "
              f"{tun['load_round_trips']} load round trips, {per_token:.0f} B back per token, "
              f"memory planned {est / 1e6:.1f} MB vs allocated {got / 1e6:.1f} MB")  # fmt: skip
        assert per_token < 8_000, per_token  # a hidden state (640 floats here) and framing; logits would be 1 MiB
        assert abs(est - got) <= 0.15 * got, (est, got)


def test_openai_sdk_through_a_worker_and_a_lite_client(mesh: dict[str, NodeProc]) -> None:
    openai = pytest.importorskip("openai")
    for n in (mesh["b"], mesh["c"]):  # a worker and a lite client say their API is up, and where it goes
        line = next((x for x in n.text().splitlines() if "API up:" in x), "")
        assert f":{n.port}/v1" in line and "served by host" in line, n.text()[-1500:]
    for n in (mesh["b"], mesh["c"]):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{n.port}/v1", api_key="unused")
        models = [m.id for m in client.models.list()]
        assert models == [models[0]] and models[0]
        chat = client.chat.completions.create(
            model=models[0], messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content
        stream = client.chat.completions.create(
            model=models[0], messages=[{"role": "user", "content": "Explain how a car engine works."}], max_tokens=8,
            temperature=0, stream=True,
        )  # fmt: skip
        pieces = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
        assert len(pieces) >= 4
        comp = client.completions.create(model=models[0], prompt="One, two,", max_tokens=4, temperature=0)
        assert comp.choices[0].text and comp.id.startswith("cmpl-"), comp.id  # OpenAI's prefix
        assert chat.id.startswith("chatcmpl-"), chat.id
        chunks = list(client.completions.create(model=models[0], prompt="One,", max_tokens=4, stream=True))
        assert chunks and all(c.id.startswith("cmpl-") for c in chunks), [c.id for c in chunks]


def test_status_command_shows_both_model_nodes(mesh: dict[str, NodeProc]) -> None:
    import os
    import subprocess
    import sys

    # at 80 columns, as a lite client sees it: the host named, nothing cut, the host's share with the output
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--port", str(mesh["c"].port)],
                       capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "host" in r.stdout and "worker" in r.stdout and "client" in r.stdout
    assert "…" not in r.stdout and max(len(x) for x in r.stdout.splitlines()) <= 80, r.stdout
    assert "host none" not in r.stdout, r.stdout
    # (a lite client knows no plan: layers "-"); the model and the API's URL
    assert re.search(r"model: \S+ — API http://127\.0\.0\.1:\d+/v1", r.stdout), r.stdout
    assert socket.gethostname()[:12] in r.stdout, r.stdout  # each node's name (here: the hostname) under its id
    for header in ("node", "role", "state", "memory", "layers", "path, RTT"):
        assert header in next(x for x in r.stdout.splitlines() if " role " in x), r.stdout
    assert re.search(r"· [\d.]+\s+ms", r.stdout), r.stdout  # each peer's RTT, at 80 columns too
    # the mesh-wide count (the host's, through gossip, on a lite client) and the latest events
    mesh_line = r"mesh: \d+ tokens generated, \d+ prompt tokens \(host [0-9a-f]{8}\); [\d.]+ tok/s now"
    assert re.search(mesh_line, r.stdout), r.stdout
    # a lite client (which plans nothing) showed the serving worker as "standby" with no layers; it now
    # shows what the host's record says: the worker serving, with its layers
    as_json = [sys.executable, "-m", "meshllm.cli", "status", "--json", "--port", str(mesh["c"].port)]
    st_c = json.loads(subprocess.run(as_json, capture_output=True, text=True, timeout=30).stdout)
    workers = [p for p in st_c["peers"] if p["role"] == "worker"]
    assert workers and all(p["state"] == "serving" and p["layers"] for p in workers), st_c["peers"]
    assert st_c["state"] == "serving" and st_c["unavailable"] is None, st_c
    # an address is never broken across lines at 80 columns
    for p in st_c["peers"]:
        for addr in re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", f"{p['path']} {p.get('rpc_path') or ''}"):
            assert addr in r.stdout, (addr, r.stdout)
    # the host's slots, as it gossips them
    assert re.search(r"slots: \d+ of [1-9]\d* busy, \d+ waiting; \d+ tokens of context each", r.stdout), r.stdout
    assert "joined" in r.stdout, r.stdout
    # the host's view, from the state dir it writes (no API needed): every share, the host's with the output
    r2 = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--state-dir", str(mesh["a"].state)],
                        capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert r2.returncode == 0 and "+ output" in r2.stdout and "…" not in r2.stdout, r2.stderr + r2.stdout
    # memory the plan uses of what each node offers, where the plan gives it a share
    st = json.loads((mesh["a"].state / "status.json").read_text())
    shares = {p["short"]: p["planned_bytes"] for p in st["peers"] if p.get("layers") or p["role"] == "host"}
    assert shares and all(isinstance(b, int) and b > 0 for b in shares.values()), st["peers"]
    for short, used in shares.items():
        assert f"{used / 1e9:.1f}/" in next(x for x in r2.stdout.splitlines() if x.startswith(short)), r2.stdout


def _chat(port: int, body: dict[str, object], key: str | None = None) -> dict[str, object]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **auth})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def test_tools_and_structured_output_through_a_split_answer_as_llama_server(mesh: dict[str, NodeProc]) -> None:
    """A chat offering a tool (``tools``, ``tool_choice``) and one asking for a JSON schema
    (``response_format``), through a worker's API and a lite client's, answer as the host's llama-server asked
    directly (its key) — the same message; the structured answer is JSON of the schema. (The tiny base model under
    its transcript template answers the tool offer in text: no tool call is made, so what this shows is that the
    fields pass through unchanged. The chats name the base model's turn stops themselves, so the API adds none and
    all three get the same request. ``cache_prompt`` off: a prompt llama-server has cached is evaluated again from
    its last token only, whose arithmetic differs — the stock split of the same layers answers the structured chat
    "New York" and then, cached, "London", a near tie.)"""
    from meshllm.llama.chat import TRANSCRIPT_STOPS

    a, b, c = mesh["a"], mesh["b"], mesh["c"]
    key = (a.state / "llama-server.key").read_text().strip()
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    place = {"type": "json_schema", "json_schema": {"name": "place", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"]}}}  # fmt: skip
    stops = list(TRANSCRIPT_STOPS)
    asks = [
        {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [weather],
         "tool_choice": "auto", "max_tokens": 24, "temperature": 0, "stop": stops, "cache_prompt": False},
        {"messages": [{"role": "user", "content": "Name a city and its country."}], "response_format": place,
         "max_tokens": 48, "temperature": 0, "stop": stops, "cache_prompt": False},
    ]  # fmt: skip
    for body in asks:
        want = _chat(llama_server_port(a), body, key)["choices"][0]["message"]  # type: ignore[index]
        for n in (b, c):
            got = _chat(n.port, body)["choices"][0]["message"]  # type: ignore[index]
            assert got == want, (n.state.name, body.get("tools") is not None, got, want)
    structured = _chat(c.port, asks[1])["choices"][0]["message"]["content"]  # type: ignore[index]
    print(f"\ntools: {_chat(c.port, asks[0])['choices'][0]['message']}; structured: {structured}")  # type: ignore[index]
    assert set(json.loads(structured)) >= {"city", "country"}, structured


def test_concurrent_requests_from_two_nodes(mesh: dict[str, NodeProc]) -> None:
    results: dict[str, str] = {}

    def ask(name: str) -> None:
        results[name] = text_of(complete(mesh[name].port, "/v1/completions", max_tokens=24, n_predict=24))

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(results) == {"b", "c"} and all(results.values())


def test_children_listen_on_loopback_and_go_with_sigterm(mesh: dict[str, NodeProc]) -> None:
    kids = []
    for n in (mesh["a"], mesh["b"], mesh["d"]):
        for p in children(n.proc):
            kids.append(p)
            # the exceptions: a worker's rpc-server's TLS listener (the direct path) and its listener for its
            # predecessor (worker to worker), where nothing gets past the handshake without the key the host (its
            # llama-server) gave (tests/integration/test_rpc_direct.py, test_pipeline.py)
            env = p.environ() if p.name() == "ggml-rpc-server" else {}
            tls = {env.get("GGML_RPC_TLS_LISTEN", ""), env.get("GGML_RPC_PEER_LISTEN", "")}
            for conn in p.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and host_port(conn.laddr.ip, conn.laddr.port) not in tls:
                    assert conn.laddr.ip == "127.0.0.1", (p.name(), conn.laddr)
    assert {p.name() for p in kids} >= {"llama-server", "ggml-rpc-server"}
    for n in mesh.values():
        n.stop()
    _, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, [p.pid for p in alive]


@contextlib.contextmanager
def two_nodes(tmp: Path, model: Path, a_args: tuple[str, ...], b_args: tuple[str, ...]) -> Iterator[list[NodeProc]]:
    """Node a founds a mesh, node b joins it with a's token; both stopped at the end."""
    a = NodeProc(tmp, "a", model, "--ctx-size", "1024", *a_args)
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        token = (a.state / "token").read_text().strip()
        nodes.append(NodeProc(tmp, "b", model, "--ctx-size", "1024", "--join", token, *b_args))
        yield nodes
    finally:
        for n in nodes:
            n.stop()


def test_a_split_with_a_draft_keeps_the_draft_on_the_host(
    tmp_path: Path, tiny_model: Path, stock_bins: Binaries
) -> None:
    """The draft model stays on the host. The worker has room for the token embedding beside its layers,
    so it holds that too (patch 0013), loaded from its own file; the answer is the stock split's."""
    host_args = ("--max-vram", "0.446", "--draft", str(tiny_model), "--rpc-path", "tunnel")  # counted bytes
    with two_nodes(tmp_path, tiny_model, host_args, ("--max-vram", "0.3")) as (a, _):
        wait_for(lambda: serves(a, 2), 120, "a split with a draft")
        assert "--spec-draft-device none" in (a.state / "llama-server.log").read_text()
        worker = _assignments(a)[0]
        out = text_of(complete(a.port, "/v1/completions"))
        tun = next(p for p in a.status()["peers"] if p["node"] == worker["node"])["tunnel"]  # type: ignore[attr-defined, index]
        # a draft model on the worker would have added its ~250 MB of buffers there
        assert tun["load_allocated"] < 1.15 * int(worker["bytes"]), (tun, worker)  # type: ignore[call-overload]
        # the embedding on the worker (llama-server says so; mesh-llm status too), loaded from the worker's own file:
        # it was asked to allocate room for the 178 MB matrix beside its layers, and no weight crossed the tunnel
        plan = a.status()["plan"]
        assert isinstance(plan, dict) and plan["embd_first"] is True, plan
        said = (a.state / "llama-server.log").read_text()
        assert re.search(r"(?m)^token embedding on 127\.0\.0\.1:\d+, with layer 0$", said), said[-3000:]
        peer = next(p for p in a.status()["peers"] if p["node"] == worker["node"])  # type: ignore[attr-defined]
        assert "with the token embedding" in peer["rpc_path"], peer
        embd = next(t.nbytes for t in read_header(tiny_model).tensors if t.name == "token_embd.weight")
        assert tun["load_allocated"] > embd and tun["load_weight_bytes"] <= 1_000_000, tun
        counts = [float(x) for x in plan["tensor_split"]]
        assert out == stock_split_text(tmp_path / "ref", stock_bins, tiny_model, counts, N)


def test_a_host_with_no_layers_keeps_the_output_and_the_logits(tmp_path: Path, tiny_model: Path) -> None:
    """Both nodes capped so the host can hold no repeating layer: the worker takes all 18, and what comes back
    from it per token is still a hidden state (logits would be 1 MiB), because the output layer stays home."""
    tun = ("--rpc-path", "tunnel")  # either may host; the tunnel counts the bytes
    with two_nodes(tmp_path, tiny_model, ("--max-vram", "0.3", *tun), ("--max-vram", "0.3", *tun)) as (a, b):
        wait_for(lambda: "ready:" in a.text() + b.text(), 120, "a split to serve")
        host = a if "ready:" in a.text() else b
        plan = host.status()["plan"]
        assert isinstance(plan, dict), plan
        counts = [x["count"] for x in plan["assignments"]]
        assert counts[-1] == 0 and sum(counts) == 18, counts  # the host holds no repeating layer
        worker = str(plan["assignments"][0]["node"])

        def received() -> int:
            peer = next(p for p in host.status()["peers"] if p["node"] == worker)  # type: ignore[attr-defined]
            return int(peer["tunnel"]["rpc_received"])

        before = received()
        out = complete(host.port, "/v1/completions")
        assert text_of(out).strip()
        per_token = (received() - before) / N
        assert per_token < 8_000, per_token  # a hidden state (640 floats here) and framing; logits would be 1 MiB
