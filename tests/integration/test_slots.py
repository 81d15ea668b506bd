"""Many users at once, on real nodes: llama-server's slots, the host's fair and bounded queue in front of them,
and the API as clients see it (any model name with one model, X-Api-Key, paths without /v1, CORS preflights of SDKs,
``n`` completions).

Two solo nodes of the tiny model serve the module: ``one`` with a single slot and a queue of two (429s, disconnects,
fairness: what one slot makes visible) and ``two`` with --parallel 2 and --ctx-size auto.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.meshlab import NodeProc, wait_for

KEY = "slot-test-key"
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def _ready(n: NodeProc) -> None:
    wait_for(lambda: "ready:" in n.text() or n.proc.poll() is not None, 180, "the node to serve")
    assert n.proc.poll() is None, n.text()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[tuple[NodeProc, NodeProc]]:
    tmp = tmp_path_factory.mktemp("slots")
    one = NodeProc(tmp, "one", tiny_model, "--parallel", "1", "--queue", "2", "--ctx-size", "4096",
                   "--api-key", KEY)  # fmt: skip
    two = NodeProc(tmp, "two", tiny_model, "--parallel", "2", "--max-vram", "1")
    try:
        _ready(one)
        _ready(two)
        yield one, two
    finally:
        one.stop()
        two.stop()


def _conn(port: int, source: str = "127.0.0.1") -> http.client.HTTPConnection:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120, source_address=(source, 0))
    c.connect()
    return c


def _send(c: http.client.HTTPConnection, path: str, body: dict[str, object], key: str | None = KEY,
          headers: dict[str, str] | None = None) -> None:  # fmt: skip
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    c.request("POST", path, json.dumps(body).encode(), h)


def _post(port: int, path: str, body: dict[str, object], key: str | None = KEY, source: str = "127.0.0.1",
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], dict[str, object]]:  # fmt: skip
    c = _conn(port, source)
    try:
        _send(c, path, body, key, headers)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")
    finally:
        c.close()


Streaming = tuple[http.client.HTTPConnection, http.client.HTTPResponse]


def _stream_first(port: int, body: dict[str, object], key: str | None = KEY) -> Streaming:
    """A streaming completion whose first token has arrived: (its connection, its response)."""
    c = _conn(port)
    _send(c, "/v1/completions", {**body, "stream": True}, key)
    r = c.getresponse()
    assert r.status == 200, r.read()
    while b'"text"' not in (line := r.readline()):
        assert line, "the stream ended before its first token"
    return c, r


def _gauge(n: NodeProc, name: str, key: str | None = KEY) -> int:
    c = _conn(n.port)
    try:
        c.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        text = c.getresponse().read().decode()
    finally:
        c.close()
    m = re.search(rf"^{name} (\d+)", text, re.M)
    return int(m.group(1)) if m else -1


def _slots_busy(n: NodeProc, key: str | None = KEY) -> int:
    return _gauge(n, "mesh_llm_slots_busy", key)


def _quick(port: int, key: str | None = KEY) -> float:
    """Seconds until a short completion answers."""
    t0 = time.monotonic()
    code, _, out = _post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0}, key)
    assert code == 200, out
    return time.monotonic() - t0


def test_a_long_request_does_not_block_a_short_one(nodes: tuple[NodeProc, NodeProc]) -> None:
    _, two = nodes
    c, r = _stream_first(two.port, LONG, key=None)
    try:
        took = _quick(two.port, key=None)
        # the long one still generates: it streams more tokens after the short one answered
        assert b'"text"' in r.readline() + r.readline() + r.readline()
    finally:
        c.close()
    assert took < 10, f"the short request took {took:.1f} s beside the long one"


def test_auto_context_loads_and_is_what_llama_server_runs(nodes: tuple[NodeProc, NodeProc]) -> None:
    _, two = nodes
    slots = two.status()["slots"]
    assert isinstance(slots, dict) and slots["total"] == 2
    assert 4096 < slots["ctx"] <= 32768  # auto: more than the floor, at most the model's trained 32768
    log = two.text_of("llama-server.log")
    assert f"n_slots = 2, n_ctx_slot = {slots['ctx']}" in log


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_slot_at_once(nodes: tuple[NodeProc, NodeProc], stream: bool) -> None:
    """One slot: a long generation whose client disconnects stops, so the next request runs at once (llama-server
    stopped generating too: with its single slot still busy the next one would wait out 4000 tokens)."""
    one, _ = nodes
    if stream:
        c, _r = _stream_first(one.port, LONG)
    else:
        c = _conn(one.port)
        _send(c, "/v1/completions", LONG)
        wait_for(lambda: _slots_busy(one) == 1, 10, "the long request to take the slot")
        time.sleep(0.5)  # generating
    c.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    c.close()
    t0 = time.monotonic()
    took = _quick(one.port)
    assert took < 3.0, f"the next request took {took:.1f} s after the client went away"
    wait_for(lambda: _slots_busy(one) == 0, 3, "the slot to be free")
    assert time.monotonic() - t0 < 4


def test_a_full_queue_answers_429_with_retry_after(nodes: tuple[NodeProc, NodeProc]) -> None:
    one, _ = nodes
    c, _r = _stream_first(one.port, LONG)
    waiting: list[tuple[int, dict[str, object]]] = []

    def wait_in_line() -> None:
        code, _, out = _post(one.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        waiting.append((code, out))

    threads = [threading.Thread(target=wait_in_line) for _ in range(2)]  # --queue 2
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        code, headers, out = _post(one.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert code == 429, out
        assert int(headers["retry-after"]) >= 1
        err = out["error"]
        assert isinstance(err, dict) and err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    finally:
        c.close()
        for t in threads:
            t.join(60)
    assert [w[0] for w in waiting] == [200, 200]  # the queued ones were served once the slot freed


def test_a_client_that_gives_up_waiting_leaves_the_queue(nodes: tuple[NodeProc, NodeProc]) -> None:
    one, _ = nodes
    c, _r = _stream_first(one.port, LONG)
    try:
        q = _conn(one.port)
        _send(q, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        wait_for(lambda: _gauge(one, "mesh_llm_queue_depth") == 1, 5, "the request to wait in the queue")
        q.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        q.close()
        wait_for(lambda: _gauge(one, "mesh_llm_queue_depth") == 0, 3, "the queue to let it go")
    finally:
        c.close()


def test_n_completions_take_n_slots(nodes: tuple[NodeProc, NodeProc]) -> None:
    _, two = nodes
    c, _r = _stream_first(two.port, {**LONG, "n": 2}, key=None)
    try:
        wait_for(lambda: _slots_busy(two, None) == 2, 5, "both slots busy")
    finally:
        c.close()


NOBODY = 65534


def _post_as(uid: int, port: int, body: dict[str, object]) -> int:
    """A completion request from a process running as ``uid`` (another local user; the system's Python, which that
    user may read, and none of our sockets: a forked child once kept the long stream's socket open); its status."""
    import subprocess
    import sys

    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    script = ("import json, sys, urllib.request, urllib.error\n"
              "req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), headers={'Content-Type': "
              "'application/json', 'Authorization': 'Bearer ' + sys.argv[3]})\n"
              "try:\n    print(urllib.request.urlopen(req, timeout=120).status)\n"
              "except urllib.error.HTTPError as e:\n    print(e.code)\n")  # fmt: skip

    def drop() -> None:
        os.setgid(uid)
        os.setuid(uid)

    r = subprocess.run([py, "-I", "-c", script, f"http://127.0.0.1:{port}/v1/completions", json.dumps(body),
                        KEY or ""], capture_output=True, text=True, timeout=180, preexec_fn=drop, cwd="/")  # fmt: skip
    out = r.stdout.strip()
    return int(out) if out.isdigit() else -1


@pytest.mark.skipif(os.getuid() != 0, reason="a request as another local user (nobody) needs root")
def test_one_burst_does_not_starve_another_client(nodes: tuple[NodeProc, NodeProc]) -> None:
    """One slot, a queue of two: our user queues two short requests behind its long one, then asks from another
    loopback address (127.0.0.2) — the same client (one client from many addresses kept every other
    out), so it gets 429, never the burst's place; then user nobody asks: its request pushes out the burst's newest
    (429 to that one) and goes next. (A client is its network, or on loopback its local user: ``gate.client_of``.)"""
    one, _ = nodes
    c, _r = _stream_first(one.port, LONG)
    done: list[tuple[str, int, float]] = []
    small = {"prompt": "Hi", "max_tokens": 2}

    def ask(source: str) -> None:
        code = _post_as(NOBODY, one.port, small) if source == "nobody" else \
            _post(one.port, "/v1/completions", small, source=source)[0]  # fmt: skip
        done.append((source, code, time.monotonic()))

    burst = [threading.Thread(target=ask, args=("127.0.0.1",)) for _ in range(2)]
    sybil = threading.Thread(target=ask, args=("127.0.0.2",))
    other = threading.Thread(target=ask, args=("nobody",))
    try:
        for t in burst:
            t.start()
            time.sleep(0.3)
        time.sleep(0.5)
        sybil.start()
        time.sleep(0.5)
        other.start()
        # the long one holds the slot until nobody's request has pushed out the burst's newest (a second 429):
        # starting a process as nobody took over a second on a busy machine, and the queue drained before it came
        deadline = time.monotonic() + 20
        while sum(code == 429 for _, code, _ in done) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        c.close()  # the long one ends: the queue drains
    for t in [*burst, sybil, other]:
        t.join(60)
    served = [s for s, code, _ in sorted(done, key=lambda d: d[2]) if code == 200]
    assert sorted(code for _, code, _ in done) == [200, 200, 429, 429], done
    assert ("127.0.0.2", 429) in {(s, code) for s, code, _ in done}, done  # the same client: no place of its own
    assert served[0] == "nobody", done


def test_the_hosts_door_shares_slots_per_node(nodes: tuple[NodeProc, NodeProc], tmp_path: Path) -> None:
    """The same as above through two lite clients: requests from other nodes reach the host through its door, and
    each node is a source of its own there (the door knows which peer's tunnel a connection bridges)."""
    one, _ = nodes
    token = (one.state / "token").read_text().strip()
    c1 = NodeProc(tmp_path, "c1", None, "--join", token)
    c2 = NodeProc(tmp_path, "c2", None, "--join", token)
    try:
        for c in (c1, c2):
            wait_for(lambda c=c: "API up:" in c.text(), 60, "a lite client's API")  # type: ignore[misc]
        c, _r = _stream_first(c1.port, LONG, key=None)
        done: list[tuple[str, int, float]] = []

        def ask(via: NodeProc) -> None:
            code, _, _out = _post(via.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None)
            done.append((via.state.name, code, time.monotonic()))

        burst = [threading.Thread(target=ask, args=(c1,)) for _ in range(2)]
        other = threading.Thread(target=ask, args=(c2,))
        try:
            for t in burst:
                t.start()
                time.sleep(0.3)
            wait_for(lambda: _gauge(one, "mesh_llm_queue_depth") == 2, 10, "c1's two requests to wait at the host")
            other.start()
            time.sleep(1.0)
        finally:
            c.close()
        for t in [*burst, other]:
            t.join(60)
        served = [s for s, code, _ in sorted(done, key=lambda d: d[2]) if code == 200]
        assert sorted(code for _, code, _ in done) == [200, 200, 429], done
        assert served[0] == "c2", done
    finally:
        c1.stop()
        c2.stop()


def test_the_api_as_clients_see_it(nodes: tuple[NodeProc, NodeProc]) -> None:
    one, two = nodes
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    # any model name reaches the one model served, and the answer names the real one
    code, _, out = _post(two.port, "/v1/chat/completions", {**body, "model": "gpt-4o-mini"}, key=None)
    assert code == 200 and out["model"] == "gemma-3-270m-q4_k_m", out
    # paths without /v1, as llama-server serves them
    code, _, out = _post(two.port, "/chat/completions", body, key=None)
    assert code == 200 and out["object"] == "chat.completion", out
    c = _conn(two.port)
    c.request("GET", "/models")
    assert json.loads(c.getresponse().read())["data"][0]["id"] == "gemma-3-270m-q4_k_m"
    c.close()
    # a count that is not a positive whole number is refused, not passed on (-1 was: "until the context is full")
    code, _, out = _post(two.port, "/v1/chat/completions", {**body, "max_tokens": -1}, key=None)
    assert code == 400 and out["error"]["param"] == "max_tokens", out  # type: ignore[index]
    # llama-server's own errors come in the API's shape (OpenAI's), without its JSON library's words
    for bad, field in (({"n": 5}, "n"), ({"temperature": "hot"}, "temperature")):
        code, _, out = _post(two.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **bad}, key=None)
        err = out["error"]
        assert code == 400 and isinstance(err, dict) and err["param"] == field, out
        assert set(err) == {"message", "type", "param", "code"} and not isinstance(err["code"], int), out
        assert "json.exception" not in err["message"], out
    # n completions, each in a slot
    code, _, out = _post(two.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "n": 2}, key=None)
    assert code == 200 and len(out["choices"]) == 2, out  # type: ignore[arg-type]
    # Anthropic's clients send X-Api-Key
    code, _, out = _post(one.port, "/v1/messages", body, key=None, headers={"X-Api-Key": KEY})
    assert code == 200 and out["type"] == "message", out
    code, _, _ = _post(one.port, "/v1/messages", body, key=None, headers={"X-Api-Key": "wrong"})
    assert code == 401
    # a loopback page using the OpenAI JS SDK: its preflight asks for x-stainless-* headers
    c = _conn(two.port)
    asks = "authorization, content-type, x-stainless-os, x-stainless-retry-count"
    c.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asks})  # fmt: skip
    r = c.getresponse()
    allowed = {h.strip().lower() for h in (r.getheader("Access-Control-Allow-Headers") or "").split(",")}
    c.close()
    assert r.status == 204 and {"x-stainless-os", "x-stainless-retry-count", "authorization"} <= allowed


def test_a_parallel_that_does_not_fit_is_refused_in_one_line(tmp_path: Path, tiny_model: Path) -> None:
    n = NodeProc(tmp_path, "big", tiny_model, "--parallel", "200", "--ctx-size", "4096", "--max-vram", "1")
    try:
        wait_for(lambda: "--parallel 200 with --ctx-size 4096 needs" in n.text(), 60, "the refusal")
        line = next(x for x in n.text().splitlines() if "--parallel 200" in x)
        k = int(line.split("--parallel ")[2].split()[0])
        assert 1 <= k < 200 and "fits" in line
        assert "llama-server ready" not in n.text()
    finally:
        n.stop()
