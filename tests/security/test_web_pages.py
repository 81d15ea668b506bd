"""Web pages in the user's browser cannot drive the API or the console: a page of another site (it sends
Origin) and a page that rebinds its DNS name to 127.0.0.1 (it sends its own Host) are refused before anything runs;
a page of a local app gets CORS headers of ours, never llama-server's (which echo any Origin, with credentials); the
console's chat takes JSON only and caps what it passes on. A real node, its real llama-server, real HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from meshllm.llama.processes import free_port
from tests.integration.meshlab import NodeProc, wait_for

BODY = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()


def _ask(url: str, method: str = "POST", data: bytes | None = BODY, **headers: str) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url, data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json", **headers})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, dict(e.headers)


def _generated(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("mesh_llm_tokens_generated_total "):
                return float(line.split()[1])
    return 0.0


def test_pages_of_other_sites_cannot_use_the_api_or_the_console(tmp_path: Path, tiny_model: Path) -> None:
    cport = free_port()
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--console", str(cport), "--max-tokens", "48")
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        api = f"http://127.0.0.1:{a.port}/v1/completions"
        assert _ask(api)[0] == 200  # a client that is no browser: no Origin
        before = _generated(a.port)
        for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                        {"Host": f"rebind.evil.example:{a.port}"}):  # fmt: skip
            status, got = _ask(api, **headers)
            assert status == 403, (headers, status)
            assert not any(k.lower().startswith("access-control-") for k in got), got
        assert _ask(api, "OPTIONS", Origin="https://evil.example")[0] == 403  # no preflight either
        assert _generated(a.port) == before  # nothing ran for them

        # a page of a local app: our CORS headers, for its origin only, without credentials
        status, got = _ask(api, Origin="http://localhost:5173")
        assert status == 200 and got.get("Access-Control-Allow-Origin") == "http://localhost:5173", got
        assert "Access-Control-Allow-Credentials" not in got, got
        status, got = _ask(api, "OPTIONS", Origin="http://localhost:5173", **{"Access-Control-Request-Method": "POST"})
        assert status == 204 and "Authorization" in got.get("Access-Control-Allow-Headers", ""), (status, got)

        # the console: the invite token not to a rebinding page, the chat not to a cross-site text/plain POST
        console = f"http://127.0.0.1:{cport}"
        before = _generated(a.port)
        assert _ask(f"{console}/token", "GET")[0] == 200
        assert _ask(f"{console}/token", "GET", Host=f"rebind.evil.example:{cport}")[0] == 403
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}).encode()
        assert _ask(f"{console}/chat", data=chat, **{"Content-Type": "text/plain"})[0] == 415
        assert _ask(f"{console}/chat", data=chat, Origin="https://evil.example")[0] == 403
        assert _generated(a.port) == before
        status, _ = _ask(f"{console}/chat", data=chat, Origin=f"http://127.0.0.1:{cport}")  # the console's own page
        assert status == 200
        # counted before the answer's end goes out (a CI run once read the counter first: it was counted after)
        wait_for(lambda: _generated(a.port) > before, 10, "the console's chat to be counted")
        assert _generated(a.port) <= before + 48  # capped (--max-tokens), not a billion tokens
        before = _generated(a.port)
        big = json.dumps({"prompt": "Once upon a time", "max_tokens": 10**9, "ignore_eos": True}).encode()
        assert _ask(api, data=big)[0] == 200
        wait_for(lambda: _generated(a.port) > before, 10, "the API's answer to be counted")
        assert _generated(a.port) == before + 48  # the API too
    finally:
        a.stop()
