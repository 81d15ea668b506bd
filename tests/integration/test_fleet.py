"""Two models in one mesh of three nodes — a hosts the tiny model, b a copy of it with other weights (one
tensor replaced, as a fine-tune would be: another fingerprint, another name), c is a lite client. Each model has its
own host; every node lists both with their hosts and nodes, answers each under its own name, and names the models
there are for one it does not serve; ``mesh-llm status`` groups the nodes by model."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.gguf_files import altered_copy

from .meshlab import NodeProc, wait_for
from .meshlab import _free_port as free_port

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"  # screenshots (git-ignored)


def _founder(tmp: Path, model: Path, nodes: list[NodeProc], *args: str) -> tuple[NodeProc, str]:
    """Node a founds the mesh with ``model`` (it goes into ``nodes``); its invite token."""
    a = NodeProc(tmp, "a", model, "--ctx-size", "1024", *args)
    nodes.append(a)
    wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
    return a, (a.state / "token").read_text().strip()


def _get(port: int, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _complete(port: int, model: str) -> tuple[int, dict[str, object]]:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _models_info(port: int) -> dict[str, dict[str, object]]:
    """Each model /v1/models lists, by name: its ``meshllm`` object (host, nodes, replicas, state)."""
    return {m["id"]: m.get("meshllm", {}) for m in _get(port, "/v1/models")["data"]}  # type: ignore[attr-defined]


def _cli(node: NodeProc, *args: str) -> str:
    """``mesh-llm ARGS`` on ``node``'s state dir: its output (the command must succeed)."""
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", *args, "--state-dir", str(node.state)],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def _children(pid: int, name: str) -> list[int]:
    """The processes named ``name`` that ``pid`` started (its children)."""
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True) if p.name() == name]


def test_two_models_each_answer_under_their_own_name_from_every_node(tmp_path: Path, tiny_model: Path,
                                                                    browser: object) -> None:  # fmt: skip
    other = altered_copy(tiny_model, tmp_path / "other-270m.gguf")
    x, y = tiny_model.stem, other.stem
    nodes: list[NodeProc] = []
    try:
        a, token = _founder(tmp_path, tiny_model, nodes)
        b = NodeProc(tmp_path, "b", other, "--ctx-size", "1024", "--join", token)
        cport = free_port()
        c = NodeProc(tmp_path, "c", None, "--client", "--join", token, "--console", str(cport))
        nodes += [b, c]
        ids = {}

        def both_listed() -> bool:
            try:
                got = {m["id"]: m for n in (a, b, c) for m in _get(n.port, "/v1/models")["data"]  # type: ignore[attr-defined]
                       if m.get("meshllm", {}).get("state") == "serving"}  # fmt: skip
            except OSError:
                return False
            ids.update(got)
            return {x, y} <= set(got)

        wait_for(both_listed, 120, "both models served")
        # the lite client's tunnels to both hosts open as they come up (not at a first request): it says so
        wait_for(lambda: f"model {x}, served by host {a.short()}" in c.text() and
                 f"model {y}, served by host {b.short()}" in c.text(), 15, "c's API lines for both models")  # fmt: skip
        assert ids[x]["meshllm"]["host"] == a.short() and ids[x]["meshllm"]["nodes"] == [a.short()]
        assert ids[y]["meshllm"]["host"] == b.short() and ids[y]["meshllm"]["nodes"] == [b.short()]
        texts: dict[str, set[str]] = {x: set(), y: set()}
        for n in (a, b, c):
            assert [m["id"] for m in _get(n.port, "/v1/models")["data"]] == sorted([x, y])  # type: ignore[index]
            for model in (x, y):  # a tunnel to the other model's host opens as it comes up: a 503 says so meanwhile
                wait_for(lambda n=n, model=model: _complete(n.port, model)[0] == 200, 15,  # type: ignore[misc]
                         f"{n.short()} to answer {model}")  # fmt: skip
                code, out = _complete(n.port, model)
                assert code == 200 and out["model"] == model, (n.short(), model, out)
                texts[model].add(out["choices"][0]["text"])  # type: ignore[index]
            code, out = _complete(n.port, "nosuch")
            assert code == 404 and out["error"]["code"] == "model_not_found", out  # type: ignore[index]
            assert f"served: {x}, {y}" in out["error"]["message"]  # type: ignore[index]
        assert len(texts[x]) == len(texts[y]) == 1 and texts[x] != texts[y], texts  # each its own model, everywhere
        # a chat through another node stops at the base model's next turn too: the host's door adds the stops
        chat = {"model": x, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0}  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{c.port}/v1/chat/completions", data=json.dumps(chat).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())["choices"][0]
        assert answer["message"]["content"] == " The capital of France is Paris." and answer["finish_reason"] == "stop"
        # one truth per model — each model's tokens and slots under its name (the mesh's line is their
        # sum, said so), /health for each, and a request naming no model goes to the node's own or is a 400
        def per_model() -> dict[str, dict[str, object]]:
            return {str(m["name"]): m for m in _get(c.port, "/mesh/status")["models"]}  # type: ignore[attr-defined]

        def summed() -> bool:  # each model's own count, from one status; together they make the mesh's
            st = _get(c.port, "/mesh/status")
            gen = {str(m["name"]): m["tokens"]["generated"] for m in st["models"]}  # type: ignore[attr-defined, index]
            return set(gen) == {x, y} and all(gen.values()) and sum(gen.values()) == st["mesh_tokens"]["generated"]  # type: ignore[index]

        wait_for(summed, 15, "each model's tokens, summing to the mesh's")
        ms = per_model()
        assert {k: m["slots"]["total"] > 0 for k, m in ms.items()} == {x: True, y: True}, ms  # type: ignore[index]
        with urllib.request.urlopen(f"http://127.0.0.1:{c.port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert f'mesh_llm_model_tokens_generated_total{{model="{y}"}}' in metrics and f'model="{x}"' in metrics
        health = _get(c.port, "/health")
        assert health["status"] == "ok" and set(health["models"]) == {x, y}, health  # type: ignore[arg-type]
        assert _get(c.port, f"/health?model={y}")["models"] == {y: {"status": "ok"}}
        bare = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{b.port}/v1/completions", data=json.dumps(bare).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["model"] == y  # b's own model
        req = urllib.request.Request(f"http://127.0.0.1:{c.port}/v1/completions", data=json.dumps(bare).encode())
        try:
            urllib.request.urlopen(req, timeout=60)
            raise AssertionError("a lite client of two models took a request naming none")
        except urllib.error.HTTPError as e:
            assert e.code == 400 and f"({x}, {y})" in json.loads(e.read())["error"]["message"]
        r = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--port", str(c.port)], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert f"hosts {a.short()} ({x}), {b.short()} ({y})" in r.stdout, r.stdout
        assert "mesh (every model's hosts): " in r.stdout and " tokens, " in r.stdout, r.stdout
        assert f"  {x}: host {a.short()} serving; nodes {a.short()}" in r.stdout, r.stdout
        assert f"  {y}: host {b.short()} serving; nodes {b.short()}" in r.stdout, r.stdout
        # the lite client's console lists both models, each with its host and nodes, and each node's model
        browser.get(f"http://127.0.0.1:{cport}/")  # type: ignore[attr-defined]
        text = lambda: browser.execute_script("return document.getElementById('m-models').innerText")  # type: ignore[attr-defined]  # noqa: E731
        wait_for(lambda: f"{x}: host {a.short()} serving · nodes {a.short()}" in text(), 20, "the console's models")
        assert f"{y}: host {b.short()} serving · nodes {b.short()}" in text(), text()
        segs = browser.execute_script(  # type: ignore[attr-defined]
            "return Array.from(document.querySelectorAll('.seg')).map(e => [e.dataset.node, e.innerText])")
        segs = dict(segs)
        assert f"host · {x}" in segs[a.short()] and f"host · {y}" in segs[b.short()], segs
        # eight nodes (five more lite clients) and two models, on a desktop and on a phone (390×844):
        # every node in the bar, no node's name or state clipped, nothing wider than the screen
        for i in range(5):
            nodes.append(NodeProc(tmp_path, f"l{i}", None, "--client", "--join", token))
        wait_for(lambda: len(_get(c.port, "/mesh/status")["peers"]) == 8, 60, "eight nodes")  # type: ignore[arg-type]
        fits = """const d = document.documentElement, segs = Array.from(document.querySelectorAll('.seg'));
            const cut = segs.flatMap(s => Array.from(s.children)).filter(e => e.scrollWidth > e.clientWidth + 1);
            return [segs.length, d.scrollWidth, window.innerWidth, cut.map(e => e.textContent)];"""
        for width, height, phone in ((1200, 900, False), (390, 844, True)):
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # type: ignore[attr-defined]
                "width": width, "height": height, "deviceScaleFactor": 3 if phone else 1, "mobile": phone})
            wait_for(lambda: browser.execute_script(fits)[0] == 8, 20, f"eight nodes at {width}×{height}")  # type: ignore[attr-defined]
            n, page, screen, cut = browser.execute_script(fits)  # type: ignore[attr-defined]
            ARTIFACTS.mkdir(exist_ok=True)
            browser.save_screenshot(str(ARTIFACTS / f"console-8-nodes-{width}x{height}.png"))  # type: ignore[attr-defined]
            assert page <= screen and not cut, (width, page, screen, cut)
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})  # type: ignore[attr-defined]
        # each host's layers, as its own model's host says (they were another model's host's, or none)
        peers = {p["short"]: p for p in _get(c.port, "/mesh/status")["peers"]}  # type: ignore[attr-defined]
        assert peers[a.short()]["layers"] == [0, 17] and peers[b.short()]["layers"] == [0, 17], peers
        # the founder drops y — no node lists it, none answers it, its host stops its llama-server and
        # stands by — then serves it again: its nodes serve it
        assert f"drop {y}:" in _cli(a, "drop", y)
        listed = lambda n: [m["id"] for m in _get(n.port, "/v1/models")["data"]]  # type: ignore[index]  # noqa: E731
        wait_for(lambda: all(listed(n) == [x] for n in (a, b, c)), 15, f"{y} gone from every node's list")
        for n in (a, b, c):
            code, out = _complete(n.port, y)
            assert code == 404 and f"was dropped from this mesh by its founder or an admin (served: {x};" in out[
                "error"]["message"], out  # type: ignore[index]
        wait_for(lambda: _get(b.port, "/mesh/status")["role"] == "worker", 10, "b to stand by")
        wait_for(lambda: not _children(b.proc.pid, "llama-server"), 10, "b's llama-server to stop")
        assert f"dropped model {y} from the mesh" in b.text() and f"dropped model {y}" in c.text()
        assert _get(c.port, "/mesh/status")["dropped"] == [y]
        wait_for(lambda: f"dropped by the founder or an admin: {y}" in _cli(c, "status"), 10, "c's status")
        assert _complete(c.port, x)[0] == 200  # the other model is served as before
        assert f"serve {y}:" in _cli(a, "serve", y)
        wait_for(lambda: all(listed(n) == sorted([x, y]) for n in (a, b, c)), 60, f"{y} served again")
        wait_for(lambda: _complete(c.port, y)[0] == 200, 60, f"c to answer {y} again")
        # y's only node leaves: a request naming y is a 503 that names it, never x's answer under y's name
        b.stop()
        nodes.remove(b)
        wait_for(lambda: all(listed(n) == [x] for n in (a, c)), 30, f"{y} gone with its node")
        for n in (a, c):
            code, out = _complete(n.port, y)
            assert code == 503 and f"model {y!r} is not served now" in out["error"]["message"], out  # type: ignore[index]
            assert out["error"]["code"] == "model_unavailable", out  # type: ignore[index]
            assert _complete(n.port, "nosuch")[0] == 404  # two models known: no stand-in for an unknown name
            code, out = _complete(n.port, x)
            assert code == 200 and out["model"] == x, out
    finally:
        for n in nodes:
            n.stop()


def _stream(port: int, body: dict[str, object], events: list[bytes], on_event: object = None) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=180) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(line.strip())
                if callable(on_event):
                    on_event(len(events))


def _text(events: list[bytes]) -> str:
    def piece(ch: dict[str, object]) -> str:
        return str(ch.get("text") or (ch.get("delta") or {}).get("content") or "")  # type: ignore[attr-defined]

    return "".join(piece(json.loads(e[6:])["choices"][0]) for e in events if e.startswith(b"data: {"))


def _slots_busy(n: NodeProc) -> int:
    """How many of ``n``'s own llama-server's slots are busy, as its record says (once a second)."""
    me = next(p for p in _get(n.port, "/mesh/status")["peers"] if p["path"] == "self")  # type: ignore[attr-defined]
    return int((me.get("slots") or [0])[0])


def _kill_mid_stream(port: int, body: dict[str, object], hosts: list[NodeProc], nodes: list[NodeProc],
                     ref: list[bytes], child: str = "", exact: bool = True) -> tuple[NodeProc, float]:  # fmt: skip
    """``body`` streamed through the API on ``port``; after 20 events, the one of ``hosts`` whose llama-server runs it
    is killed -9 (and taken out of ``nodes``; with ``child``, only that child process of it). The answer must be one
    stream with no error and ``ref``'s text (not ``exact``: its first 20 events' text, then more — two servers whose
    prompt caches differ may part at a near tie). The node killed, and the client's longest wait between events."""
    wait_for(lambda: not any(_slots_busy(n) for n in hosts), 10, "every host idle (records say so each second)")
    events: list[bytes] = []
    stamps: list[float] = []
    started = threading.Event()

    def on_event(k: int) -> None:
        stamps.append(time.monotonic())
        if k == 20:
            started.set()

    th = threading.Thread(target=_stream, args=(port, body, events, on_event))
    th.start()
    assert started.wait(60), "the stream did not start"
    wait_for(lambda: len([n for n in hosts if _slots_busy(n)]) == 1, 10, "the stream's host")
    victim = next(n for n in hosts if _slots_busy(n))
    if child:
        victim.kill_child(child)
    else:
        victim.stop(signal.SIGKILL)
        nodes.remove(victim)
    th.join(180)
    assert not th.is_alive(), "the stream hung"
    assert not any(b'"error"' in e for e in events), events[-3:]
    assert events[-1] == b"data: [DONE]", events[-3:]
    if exact:
        assert _text(events) == _text(ref), (_text(events), _text(ref))
    else:
        head = _text(ref[:20])
        assert _text(events).startswith(head) and len(_text(events)) > len(head) + 20, (_text(events), head)
    return victim, max(y - x for x, y in itertools.pairwise(stamps))


def test_a_streamed_answer_survives_its_host_s_kill_9(tmp_path: Path, tiny_model: Path) -> None:
    """A, b and d hold the model whole (one hosts, the others serve replicas: 3), c is a lite
    client. A greedy answer streamed through c whose host is killed -9 mid-way goes on at another: one stream, no
    error event, and the text of the uninterrupted answer — a completion, then a chat (its host killed in turn)."""

    nodes: list[NodeProc] = []
    try:
        _, token = _founder(tmp_path, tiny_model, nodes)
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join", token)
        d = NodeProc(tmp_path, "d", tiny_model, "--ctx-size", "1024", "--join", token)
        c = NodeProc(tmp_path, "c", None, "--client", "--join", token)
        nodes += [b, d, c]

        def answers() -> bool:
            try:
                return _complete(c.port, tiny_model.stem)[0] == 200
            except OSError:
                return False

        wait_for(answers, 120, "c to answer")
        completion = {"model": tiny_model.stem, "prompt": "Count from 1 to 100, separated by commas: 1, 2,",
                      "max_tokens": 160, "temperature": 0, "stream": True}  # fmt: skip
        chat = {"model": tiny_model.stem, "messages": [{"role": "user", "content": "Explain how a car engine works."}],
                "max_tokens": 160, "temperature": 0, "stream": True}  # fmt: skip
        refs: list[list[bytes]] = [[], []]
        for body, ref in zip((completion, chat), refs, strict=True):
            _stream(c.port, body, ref)
            assert ref[-1] == b"data: [DONE]" and len(_text(ref)) > 100, ref[-3:]
        for body, ref in zip((completion, chat), refs, strict=True):
            _, stall = _kill_mid_stream(c.port, body, [n for n in nodes if n is not c], nodes, ref)
            kind = "chat" if "messages" in body else "completion"
            print(f"\nhost kill -9 mid-stream ({kind}): the client's longest wait between events {stall:.1f} s; "
                  "the uninterrupted text")  # fmt: skip
            wait_for(answers, 120, "c to answer again")
        assert "continuing on" in c.text(), c.text()[-2000:]
    finally:
        for n in nodes:
            n.stop()


def test_a_node_with_model_auto_joins_the_model_that_needs_it_most(tmp_path: Path, tiny_model: Path) -> None:
    """B serves the tiny model alone; d, started with ``--model auto`` and an empty models dir, takes it
    up (the only model: its plan does not use d). Then a joins with another model and too little memory for it
    alone (its plan waits for peers): d lets the tiny model go and joins the model that waits — fetching its layers
    from a — and that model's split serves, the tiny one as before."""
    other = altered_copy(tiny_model, tmp_path / "other-270m.gguf")
    nodes: list[NodeProc] = []
    try:
        b, token = _founder(tmp_path, tiny_model, nodes)
        wait_for(lambda: "ready:" in b.text(), 60, "b serving")
        d = NodeProc(tmp_path, "d", None, "--model", "auto", "--models-dir", str(tmp_path / "d-models"),
                     "--max-vram", "0.3", "--ctx-size", "1024", "--join", token, auto=True)  # fmt: skip
        nodes.append(d)
        wait_for(lambda: (d.state / "key").exists(), 30, "d's key")
        wait_for(lambda: d.short() in (_models_info(b.port).get(tiny_model.stem, {}).get("nodes") or []), 60,
                 "d to take up the tiny model")  # type: ignore[operator]  # fmt: skip
        a = NodeProc(tmp_path, "w", other, "--max-vram", "0.446", "--ctx-size", "1024", "--join", token)
        nodes.append(a)
        wait_for(lambda: "ready:" in a.text(), 120, "the waiting model's split to serve")
        assert "waiting for more peers" in a.text(), a.text()[-2000:]
        moved = f"{other.stem} waits for memory and {tiny_model.stem} does not use this node: this node (--model " \
                "auto) lets its model go"
        assert moved in d.text() and f"the model that needs this node most is {other.stem}" in d.text(), d.text()
        assert "fetched layers" in d.text() and not (tmp_path / "d-models" / other.name).exists()
        for n in (a, b, d):
            assert _complete(n.port, tiny_model.stem)[0] == 200 and _complete(n.port, other.stem)[0] == 200
    finally:
        for n in nodes:
            n.stop()


def test_a_dropped_model_and_one_asked_for_that_a_node_serving_nothing_takes_up(tmp_path: Path, tiny_model: Path
                                                                                 ) -> None:  # fmt: skip
    """The founder drops the model it serves — nothing is served, a request for it is a 404 saying so;
    d joins with --model auto and serves nothing; `mesh-llm serve` of a name nobody can fetch leaves it so, with a
    line saying why; `mesh-llm serve gemma3-270m` (the catalog's name, installed here) and d takes it up and serves
    it, reached through the founder, whose dropped copy of the same file stays stopped."""
    nodes: list[NodeProc] = []
    try:
        a, token = _founder(tmp_path, tiny_model, nodes)
        wait_for(lambda: "ready:" in a.text(), 60, "a serving")
        assert "drop" in _cli(a, "drop", tiny_model.stem)
        wait_for(lambda: _get(a.port, "/v1/models")["data"] == [], 15, "nothing served")
        wait_for(lambda: not _children(a.proc.pid, "llama-server"), 10, "a's llama-server to stop")
        code, out = _complete(a.port, tiny_model.stem)
        assert code == 404 and "was dropped from this mesh" in out["error"]["message"], out  # type: ignore[index]
        d = NodeProc(tmp_path, "d", None, "--model", "auto", "--ctx-size", "1024", "--join", token, auto=True)
        nodes.append(d)
        wait_for(lambda: "serving nothing until it does" in d.text(), 60, "d to serve nothing")
        _cli(a, "serve", "no-such-model")
        wait_for(lambda: "cannot serve no-such-model: unknown model" in d.text(), 30, "d to say why not")
        _cli(a, "serve", "gemma3-270m")
        served = lambda: [m["id"] for m in _get(a.port, "/v1/models")["data"]]  # type: ignore[index]  # noqa: E731
        wait_for(lambda: served() == ["gemma3-270m"], 90, "gemma3-270m served")
        wait_for(lambda: _complete(a.port, "gemma3-270m")[0] == 200, 60, "a to answer through d")
        assert "no node holds it: this node takes it up" in d.text() and _children(d.proc.pid, "llama-server")
        assert _complete(a.port, tiny_model.stem)[0] == 404 and not _children(a.proc.pid, "llama-server")
        # dropped in turn: d (--model auto) lets it go — nothing of it runs — and takes up the model the founder
        # serves again
        _cli(a, "drop", "gemma3-270m")
        let_go = "gemma3-270m was dropped: this node (--model auto) lets its model go"
        wait_for(lambda: let_go in d.text(), 30, "d to let go")
        wait_for(lambda: not _children(d.proc.pid, "llama-server") and not _children(d.proc.pid, "ggml-rpc-server"),
                 15, "d's llama-server and rpc-server to stop")  # fmt: skip
        _cli(a, "serve", tiny_model.stem)
        nodes_of = lambda: _models_info(a.port).get(tiny_model.stem, {}).get("nodes") or []  # noqa: E731
        wait_for(lambda: d.short() in nodes_of(), 90, f"d to take up {tiny_model.stem}")  # type: ignore[operator]
        wait_for(lambda: _complete(d.port, tiny_model.stem)[0] == 200, 60, "d to answer the founder's model")
    finally:
        for n in nodes:
            n.stop()
