"""--max-tokens and the API's endpoints, performed against the real API in front of a real llama-server.
Each way around the cap the audit found (a body sent as text/plain or with no Content-Type, llama-server's own
n_predict, /v1/messages, /v1/responses, a dot segment to llama-server's /completion) and each way to llama-server's
own endpoints (/slots, /props) is tried; and a client that goes away stops the generation it asked for."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from meshllm.llama.processes import free_port
from meshllm.serve.http.api import Api
from meshllm.serve.http.upstream import Upstream

CAP = 12


async def _api(upstream: Upstream, cap: int | None) -> tuple[Api, str]:
    api = Api(lambda _m: upstream, lambda: ["tiny"], lambda: {}, max_tokens=cap)
    port = await api.start("127.0.0.1", free_port())
    return api, f"http://127.0.0.1:{port}"


def _generated(status: int, text: str) -> int:
    """Tokens a response says were generated (every endpoint's own usage shape), or -1 for an error."""
    if status != 200:
        return -1
    obj = json.loads(text)
    usage = obj.get("usage") or {}
    return int(usage.get("completion_tokens") or usage.get("output_tokens") or obj.get("tokens_predicted") or 0)


@pytest.mark.asyncio
async def test_every_generating_endpoint_is_capped_and_nothing_else_passes(llama: Upstream) -> None:
    api, base = await _api(llama, CAP)
    many = 10**6
    chat = [{"role": "user", "content": "Tell me a long story"}]
    tries = [  # (what, path, body, headers)
        ("text/plain body", "/v1/completions", {"prompt": "Once", "max_tokens": many, "ignore_eos": True},
         {"Content-Type": "text/plain"}),
        ("no Content-Type, n_predict", "/v1/completions", {"prompt": "Once", "n_predict": many, "ignore_eos": True},
         {}),
        ("chat, max_completion_tokens", "/v1/chat/completions",
         {"messages": chat, "max_completion_tokens": many, "ignore_eos": True}, {"Content-Type": "application/json"}),
        ("/v1/messages", "/v1/messages", {"messages": chat, "max_tokens": many}, {"Content-Type": "application/json"}),
        ("/v1/messages, n_predict only", "/v1/messages", {"messages": chat, "n_predict": 4}, {}),
        ("/v1/responses", "/v1/responses", {"input": "Tell me a story", "max_output_tokens": many, "n_predict": many},
         {"Content-Type": "application/json"}),
        ("/v1/responses, no field", "/v1/responses", {"input": "Tell me a story", "n_predict": many}, {}),
        ("bare /completions", "/completions", {"prompt": "Once", "max_tokens": many, "ignore_eos": True}, {}),
        ("bare /chat/completions", "/chat/completions", {"messages": chat, "ignore_eos": True}, {}),
    ]  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            for what, path, body, headers in tries:
                async with http.post(base + path, data=json.dumps(body).encode(), headers=headers) as r:
                    n = _generated(r.status, await r.text())
                assert 0 < n <= CAP, f"{what}: {n} tokens generated (cap {CAP})"
            dotted = [("POST", "/v1/../completion"), ("POST", "/v1/%2e%2e/completion"), ("GET", "/v1/../slots"),
                      ("GET", "/v1/%2E%2E/props"), ("GET", "/v1/..%2fslots")]  # fmt: skip
            for method, path in dotted:
                async with http.request(method, aiohttp.client.URL(base + path, encoded=True),
                                        data=json.dumps({"prompt": "x", "n_predict": many})) as r:  # fmt: skip
                    assert r.status == 400, (method, path, r.status, await r.text())
            for method, path in [("GET", "/v1/slots"), ("GET", "/v1/props"), ("POST", "/v1/chat/completions/control"),
                                 ("GET", "/v1/health/../../slots"), ("POST", "/v1/completion")]:  # fmt: skip
                async with http.request(method, aiohttp.client.URL(base + path, encoded=True), data=b"{}") as r:
                    assert r.status in (400, 404), (method, path, r.status)
                    assert "slots" not in (await r.text()).lower() or r.status != 200
            async with http.get(base + "/v1/completions") as r:
                assert r.status == 405
    finally:
        await api.stop()


@pytest.mark.asyncio
async def test_a_client_that_goes_away_stops_its_generation(llama: Upstream) -> None:
    """A non-streamed request for 1,500 tokens whose client hangs up after 1 s: llama-server (one slot) is free again
    at once — the next request answers in seconds, not after the abandoned one's minute of generating."""
    api, base = await _api(llama, None)
    long = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(TimeoutError):
                async with http.post(base + "/v1/completions", json=long, timeout=aiohttp.ClientTimeout(total=1.0)):
                    pass
            t0 = time.monotonic()
            async with http.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}) as r:
                assert r.status == 200
            took = time.monotonic() - t0
        assert took < 10, f"the next request waited {took:.1f} s: the abandoned generation went on"
    finally:
        await api.stop()
        await asyncio.sleep(0)
