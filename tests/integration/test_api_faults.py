"""The API's answers when its model server fails (serve/http/api.py), against a real llama-server with faults injected
on the TCP path to it: nothing sent yet → one retry on whatever serves the model next; already streaming → an error
event and the end of the response, never a hang; nobody serving → 503 with the reason and Retry-After."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from meshllm.llama.processes import free_port
from meshllm.proto import resume
from meshllm.serve.http import answers
from meshllm.serve.http import api as api_mod
from meshllm.serve.http.api import Api
from meshllm.serve.http.upstream import Unavailable, Upstream

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}


async def _closing_server() -> tuple[asyncio.Server, str]:
    """A model server that accepts and hangs up before answering."""

    async def hang_up(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    srv = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def _cutting_proxy(target: str, cut_after: int, seen: list[bytes] | None = None) -> tuple[asyncio.Server, str]:
    """A TCP relay to ``target`` that drops both connections after ``cut_after`` bytes of response; ``seen``: the
    request bytes it relays."""
    host, port = target.removeprefix("http://").split(":")

    async def relay(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(host, int(port))

        async def up() -> None:
            while data := await cr.read(65536):
                uw.write(data)
                if seen is not None:
                    seen.append(data)

        task = asyncio.ensure_future(up())
        sent = 0
        while sent < cut_after and (data := await ur.read(min(65536, cut_after - sent))):
            cw.write(data)
            await cw.drain()
            sent += len(data)
        task.cancel()
        for w in (cw, uw):
            w.transport.abort()

    srv = await asyncio.start_server(relay, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


class Routes:
    """The router the API asks, answering from a script: one answer per call, the last one repeated."""

    def __init__(self, *answers: Upstream | Unavailable) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self, model: str | None) -> Upstream | Unavailable | None:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def _api(routes: Routes) -> tuple[Api, str]:
    a = Api(routes, models=lambda: ["tiny"], status=dict)
    port = free_port()
    await a.start("127.0.0.1", port)
    return a, f"http://127.0.0.1:{port}"


async def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        return r.status, dict(r.headers), await r.read()


async def test_a_request_that_failed_before_any_output_is_retried_once(
    llama: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    dead, dead_url = await _closing_server()
    routes = Routes(Upstream("tiny", dead_url), llama)
    a, url = await _api(routes)
    try:
        with caplog.at_level(logging.WARNING, "meshllm.api"):
            status, _, body = await _post(url, BODY)
        assert status == 200 and json.loads(body)["choices"][0]["text"], body
        assert routes.calls == 2
        assert any("failed before any output" in r.getMessage() and "retrying once" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
    finally:
        await a.stop()
        dead.close()


async def test_the_retry_is_only_one(llama: Upstream) -> None:
    dead, dead_url = await _closing_server()
    routes = Routes(Upstream("tiny", dead_url))  # the mesh keeps pointing at a dead server
    a, url = await _api(routes)
    try:
        status, headers, body = await _post(url, BODY)
        err = json.loads(body)["error"]
        assert status == 503 and headers["Retry-After"] == "5" and err["code"] == "model_unavailable"
        assert err["message"].startswith("the model server failed: ") and routes.calls == 2
    finally:
        await a.stop()
        dead.close()


async def test_a_retry_that_finds_nobody_serving_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_mod, "RETRY_WAIT_S", 1.5)
    dead, dead_url = await _closing_server()
    waiting = Unavailable("waiting for more peers — need 2.0 GB, have 1.0 GB", retry_after_s=7)
    routes = Routes(Upstream("tiny", dead_url), waiting)
    a, url = await _api(routes)
    try:
        status, headers, body = await _post(url, BODY)
        assert status == 503 and json.loads(body)["error"]["message"] == waiting.reason
        assert headers["Retry-After"] == "5" and routes.calls >= 3  # it kept asking until its deadline
        status, headers, body = await _post(url, BODY)  # and a new request is refused at once, with its wait
        assert status == 503 and headers["Retry-After"] == "7"
        assert json.loads(body)["error"]["message"] == waiting.reason
    finally:
        await a.stop()
        dead.close()


def _events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


def _text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0].get("text") or "" for e in events if e.startswith("{"))


async def test_a_stream_cut_mid_way_goes_on_where_it_was_cut(llama: Upstream) -> None:
    """The model server's connection drops after a few events; the answer goes on in the same stream on
    whatever serves the model next (here the same llama-server, directly): the uninterrupted text, no error."""
    a, url = await _api(Routes(llama))
    try:
        _, _, whole = await asyncio.wait_for(_post(url, {**BODY, "max_tokens": 120, "stream": True}), 120)
    finally:
        await a.stop()
    proxy, proxy_url = await _cutting_proxy(llama.base_url, cut_after=1500)  # the headers and a few events
    routes = Routes(Upstream("tiny", proxy_url, llama.key), llama)
    a, url = await _api(routes)
    try:
        status, _, body = await asyncio.wait_for(_post(url, {**BODY, "max_tokens": 120, "stream": True}), 120)
        events = _events(body)
        assert status == 200 and events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert _text(events) == _text(_events(whole)) and len(_text(events)) > 60
        assert routes.calls >= 2, "it went on where the first upstream failed"
    finally:
        await a.stop()
        proxy.close()


async def test_a_long_answer_cut_goes_on_after_one_prefill_of_what_was_sent(
    llama: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer cut after more than REPLAY_MAX_TOKENS tokens goes on from its prompt extended by the
    text sent — one prefill, only the rest generated — not from a regeneration token by token (which keeps the
    uninterrupted text but costs the tokens' decode time again): one stream, no error, as many tokens as asked."""
    monkeypatch.setattr(resume, "REPLAY_MAX_TOKENS", 4)
    first, first_url = await _cutting_proxy(llama.base_url, cut_after=1500)  # the headers and a few events
    seen: list[bytes] = []
    second, second_url = await _cutting_proxy(llama.base_url, cut_after=1 << 30, seen=seen)
    routes = Routes(Upstream("tiny", first_url, llama.key), Upstream("tiny", second_url, llama.key))
    a, url = await _api(routes)
    try:
        status, _, body = await asyncio.wait_for(_post(url, {**BODY, "max_tokens": 120, "stream": True}), 120)
        events = _events(body)
        assert status == 200 and events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        asked = json.loads(b"".join(seen).split(b"\r\n\r\n", 1)[1])
        prompt = str(BODY["prompt"])
        sent = asked["prompt"][len(prompt) :]
        assert asked["prompt"].startswith(prompt) and sent and _text(events).startswith(sent), (asked, events[:3])
        pieces = sum(1 for e in events if e.startswith("{") and json.loads(e)["choices"][0].get("text"))
        assert asked["max_tokens"] < 120 and pieces == 120, (asked["max_tokens"], pieces)
    finally:
        await a.stop()
        first.close()
        second.close()


async def test_two_cuts_in_one_stream_each_get_their_own_wait_and_the_client_hears_all_along(
    llama: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host cut mid-stream, ~2 s with no model server, the next one cut too, ~2 s again, then one
    that serves: the answer ends whole (the uninterrupted text, no error) although the two waits together outlast
    one wait (3 s here) — each cut waits anew — and the client hears an SSE comment at least every KEEPALIVE_S
    while nothing else comes (a client or proxy read timeout does not end an answer about to go on)."""
    monkeypatch.setattr(api_mod, "RETRY_WAIT_S", 3.0)
    monkeypatch.setattr(answers, "KEEPALIVE_S", 0.5)
    body = {**BODY, "max_tokens": 120, "stream": True}
    a, url = await _api(Routes(llama))
    try:
        _, _, whole = await asyncio.wait_for(_post(url, body), 120)
    finally:
        await a.stop()
    first, first_url = await _cutting_proxy(llama.base_url, cut_after=1500)
    second, second_url = await _cutting_proxy(llama.base_url, cut_after=4500)  # the replay, then a few more events
    gone = Unavailable("the host is unreachable: electing another")
    routes = Routes(Upstream("tiny", first_url, llama.key), *[gone] * 4, Upstream("tiny", second_url, llama.key),
                    *[gone] * 4, llama)  # fmt: skip
    a, url = await _api(routes)
    loop = asyncio.get_running_loop()
    try:
        got, gaps = b"", []
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s,
            s.post(url + "/v1/completions", json=body) as r,
        ):
            last = loop.time()
            async for chunk in r.content.iter_any():
                gaps.append(loop.time() - last)
                last, got = loop.time(), got + chunk
        events = _events(got)
        assert r.status == 200 and events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert _text(events) == _text(_events(whole)) and len(_text(events)) > 60
        assert routes.calls >= 11 and got.count(answers.KEEPALIVE) >= 4, (routes.calls, got[:600])
        print(f"\ntwo cuts: longest client silence {max(gaps[1:]):.2f} s, {got.count(answers.KEEPALIVE)} keep-alives")
        assert max(gaps[1:]) < 1.5, gaps
    finally:
        await a.stop()
        first.close()
        second.close()


async def test_a_stream_whose_host_goes_silent_goes_on_elsewhere(llama: Upstream) -> None:
    """A host killed -9 mid-stream leaves its tunnel open until the mesh declares it dead (6 s): an answer
    that brings nothing for a second asks whether the mesh still hears from its node, and goes on at the next host
    as soon as it does not. Here the relay stops passing bytes (the connection stays open) and the node falls silent
    with it."""
    a, url = await _api(Routes(llama))
    try:
        _, _, whole = await asyncio.wait_for(_post(url, {**BODY, "max_tokens": 120, "stream": True}), 120)
    finally:
        await a.stop()
    host, port = llama.base_url.removeprefix("http://").split(":")
    stalled = asyncio.Event()

    async def relay(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(host, int(port))
        uw.write(await cr.readuntil(b"\r\n\r\n") + await cr.read(65536))
        sent = 0
        while sent < 1500 and (data := await ur.read(1500 - sent)):
            cw.write(data)
            sent += len(data)
        stalled.set()
        await asyncio.sleep(3600)  # open, silent: a dead host's tunnel before the mesh notices

    srv = await asyncio.start_server(relay, "127.0.0.1", 0)
    silent = Upstream("tiny", f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", llama.key,
                      alive=lambda: not stalled.is_set())  # fmt: skip
    routes = Routes(silent, llama)
    a, url = await _api(routes)
    try:
        t0 = asyncio.get_running_loop().time()
        status, _, body = await asyncio.wait_for(_post(url, {**BODY, "max_tokens": 120, "stream": True}), 30)
        events = _events(body)
        assert status == 200 and events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert _text(events) == _text(_events(whole)) and routes.calls >= 2
        print(f"\nsilent host: the answer went on elsewhere; whole in {asyncio.get_running_loop().time() - t0:.1f} s")
    finally:
        await a.stop()
        srv.close()


async def test_a_stream_that_cannot_go_on_ends_with_an_error_event(llama: Upstream) -> None:
    """A prompt of token ids cannot be continued: the stream ends with an error event (never a hang), and the
    request is not sent again."""
    proxy, proxy_url = await _cutting_proxy(llama.base_url, cut_after=1500)  # the headers and a few events
    routes = Routes(Upstream("tiny", proxy_url, llama.key), llama)
    a, url = await _api(routes)
    try:
        body_in = {**BODY, "prompt": [2, 9259, 3324, 496, 990], "max_tokens": 200, "stream": True}
        status, _, body = await asyncio.wait_for(_post(url, body_in), 60)
        events = _events(body)
        assert status == 200 and len(events) >= 2, body
        assert json.loads(events[0])["choices"], events[0]  # real tokens came first
        assert json.loads(events[-1])["error"]["type"] == "upstream_error", events[-1]
        assert routes.calls == 1, "a request that already streamed must not be sent again"
    finally:
        await a.stop()
        proxy.close()


async def test_every_request_to_llama_server_has_a_connection_of_its_own(llama: Upstream) -> None:
    """llama-server's HTTP server closes a connection after a streamed answer without saying so; a pooled connection
    reused just then failed its request before any byte ("Server disconnected", "Can not write request body": 8 of
    96 streamed requests, 16 at a time on 4 slots, a 503 when the retry met one too). The API never reuses one."""
    opened = 0
    host, port = llama.base_url.removeprefix("http://").split(":")

    async def relay(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        ur, uw = await asyncio.open_connection(host, int(port))

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.close()

        await asyncio.gather(pipe(cr, uw), pipe(ur, cw), return_exceptions=True)

    srv = await asyncio.start_server(relay, "127.0.0.1", 0)
    via = Upstream("tiny", f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", llama.key)
    a, url = await _api(Routes(via))
    try:
        for stream in (False, False, True):  # back to back
            assert (await _post(url, {**BODY, "max_tokens": 2, "stream": stream}))[0] == 200
        assert opened == 3, "a connection was reused"
    finally:
        await a.stop()
        srv.close()


async def test_an_upstream_error_keeps_its_retry_after_and_llama_servers_fields() -> None:
    """A lite client dropped Retry-After from the host's 429, and llama-server's own fields of an error
    (``n_prompt_tokens``, ``n_ctx`` of a context overflow) were lost on the way. The upstream here is a stand-in for
    the host's door (its answers as the door and llama-server give them: status, Retry-After, the error object)."""
    from aiohttp import web

    answers = {
        "busy": (429, {"Retry-After": "3"}, {"error": {"code": 429, "message": "all slots busy",
                                                        "type": "rate_limit_error"}}),
        "long": (400, {}, {"error": {"code": 400, "message": "the request exceeds the available context size",
                                     "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}}),
    }  # fmt: skip

    async def answer(request: web.Request) -> web.Response:
        status, headers, body = answers[(await request.json())["prompt"]]
        return web.json_response(body, status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    a, url = await _api(Routes(Upstream("tiny", f"http://127.0.0.1:{port}")))
    try:
        status, headers, body = await _post(url, {**BODY, "prompt": "busy"})
        assert status == 429 and headers.get("Retry-After") == "3", (headers, body)
        status, headers, body = await _post(url, {**BODY, "prompt": "long"})
        err = json.loads(body)["error"]
        assert status == 400 and (err["n_prompt_tokens"], err["n_ctx"]) == (5000, 4096), err
        assert err["type"] == "exceed_context_size_error" and "Retry-After" not in headers
    finally:
        await a.stop()
        await runner.cleanup()


async def test_a_mesh_of_several_models_answers_per_model_and_asks_which_when_a_request_names_none() -> None:
    """With two models served (one up, one without a host), a request naming none goes to this node's own
    model, and where the node has none (a lite client) it is a 400 listing them — not whichever model sorts first.
    ``/health`` is "ok" only when every model answers, says each one's state under its name, and answers for one
    model with ``?model=``."""
    asked: list[str | None] = []

    def route(model: str | None) -> Upstream | Unavailable | None:
        asked.append(model)
        return Upstream("a", "http://127.0.0.1:9") if model == "a" else Unavailable("no host elected yet")

    async def run(own: str | None) -> tuple[int, dict[str, object]]:
        a = Api(route, models=lambda: ["a", "b"], status=dict, default_model=lambda: own)
        port = free_port()
        await a.start("127.0.0.1", port)
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}) as r,
            ):
                return r.status, await r.json()
        finally:
            await a.stop()

    status, body = await run("b")
    assert (status, asked) == (503, ["b"]), body  # the node's own model, which has no host yet
    asked.clear()
    status, body = await run(None)
    assert status == 400 and asked == [], body
    assert body["error"]["message"] == "this mesh serves several models (a, b): name one in 'model'", body  # type: ignore[index]

    a = Api(route, models=lambda: ["a", "b"], status=dict, default_model=lambda: "a")
    port = free_port()
    await a.start("127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 503, await r.text()
                got = await r.json()
                assert got["models"] == {"a": {"status": "ok"}, "b": {"status": "unavailable",
                                                                      "reason": "no host elected yet"}}, got
                assert (got["model"], got["reason"]) == ("b", "no host elected yet"), got
            async with s.get(f"http://127.0.0.1:{port}/health?model=a") as r:
                assert r.status == 200 and (await r.json())["models"] == {"a": {"status": "ok"}}
            async with s.get(f"http://127.0.0.1:{port}/health?model=c") as r:
                assert r.status == 404 and "served: a, b" in (await r.json())["reason"]
    finally:
        await a.stop()
