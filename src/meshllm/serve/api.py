"""The OpenAI-compatible API on :9337 that every node serves.

Requests go to an upstream chosen by the request's ``model`` field: the local llama-server on the host, or (on
other nodes) a tunnel to the host ([serve] step 2). Responses are streamed through as they come, so SSE arrives
token by token. With no upstream yet the answer is 503 with a JSON body that says why.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from meshllm.serve import webguard
from meshllm.serve.metrics import CONTENT_TYPE, Counters

log = logging.getLogger("meshllm.api")

RETRY_WAIT_S = 60.0  # how long a failed request waits for the mesh to serve again before its one retry
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}


@dataclass(frozen=True)
class Upstream:
    """Where a model is served: an HTTP base URL reachable from this process (a local port or a tunnel)."""

    model: str
    base_url: str


@dataclass(frozen=True)
class Unavailable:
    reason: str
    retry_after_s: int = 5


Router = Callable[[str | None], Upstream | Unavailable | None]  # None: no such model


class _TokenTally:
    """Counts generated tokens in a response as it passes: SSE content events, or the JSON usage."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.buf = b""
        self.tokens = 0
        self.tps = 0.0
        self.decode_s = 0.0

    def feed(self, chunk: bytes) -> None:
        if not self.sse:
            if len(self.buf) < (1 << 20):
                self.buf += chunk
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: {"):
                self._event(line[6:])

    def _event(self, raw: bytes) -> None:
        try:
            ev = json.loads(raw)
        except ValueError:
            return
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") or ch.get("text")
            if piece:
                self.tokens += 1
        t = ev.get("timings")
        if isinstance(t, dict) and t.get("predicted_per_second"):
            self.tps = float(t["predicted_per_second"])
            self.decode_s = float(t.get("predicted_ms") or 0.0) / 1000.0

    def done(self, c: Counters) -> None:
        if not self.sse:
            try:
                obj = json.loads(self.buf)
                self.tokens = int((obj.get("usage") or {}).get("completion_tokens") or obj.get("tokens_predicted") or 0)
                t = obj.get("timings") or {}
                self.tps = float(t.get("predicted_per_second") or 0.0)
                self.decode_s = float(t.get("predicted_ms") or 0.0) / 1000.0
            except (ValueError, AttributeError, TypeError):
                return
        c.tokens_generated += self.tokens
        c.decode_seconds += self.decode_s
        if self.tps:
            c.last_tokens_per_second = self.tps


def _json(status: int, obj: object, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj), content_type="application/json", headers=headers)


def _error(
    status: int,
    message: str,
    kind: str,
    headers: dict[str, str] | None = None,
    *,
    code: str | None = None,
    param: str | None = None,
) -> web.Response:
    """An error in OpenAI's shape: ``code`` a string such as "model_not_found" (or null), ``param`` the field at
    fault (or null); what the SDKs read into their exceptions."""
    err = {"message": message, "type": kind, "param": param, "code": code}
    return _json(status, {"error": err}, headers)


# what each endpoint cannot do without (llama-server's own answer would leak its JSON library's exception text)
REQUIRED = {"/v1/completions": ("prompt", (str, list)), "/v1/chat/completions": ("messages", (list,))}


TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")  # OpenAI's two names and llama-server's own


def cap_tokens(req: dict[str, object], cap: int) -> dict[str, object] | None:
    """A completion request asking for more than ``cap`` tokens (or not saying: until the context is full) made to
    ask for ``cap`` at most; None when it already does."""
    asked = [req.get(f) for f in TOKEN_FIELDS if f in req]
    if asked and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= cap for n in asked):
        return None
    return {**{k: v for k, v in req.items() if k not in TOKEN_FIELDS}, "max_tokens": cap}


def _openai_ids(body: bytes) -> bytes:
    return body.replace(b'"id":"chatcmpl-', b'"id":"cmpl-')


class Api:
    def __init__(
        self,
        router: Router,
        models: Callable[[], list[str]],
        status: Callable[[], dict[str, object]],
        api_key: str | None = None,
        metrics: Callable[[], str] | None = None,
        listen_all: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        self.router = router
        self.max_tokens = max_tokens  # --max-tokens: the most a completion request may ask for (None: no cap)
        self.metrics = metrics
        self.counters = Counters()
        self.models = models
        self.status = status
        self.api_key = api_key
        self.requests: dict[int, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        guard = webguard.middleware(listen_all)  # web pages of other sites, DNS rebinding (serve/webguard.py)
        self.app = web.Application(middlewares=[guard, self._auth], client_max_size=64 << 20)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_get("/v1/models/{model:.+}", self.get_model)
        self.created = int(time.time())  # the models' "created" (OpenAI's model objects carry one)
        self.app.router.add_get("/mesh/status", self.mesh_status)
        self.app.router.add_get("/metrics", self.get_metrics)
        self.app.router.add_route("*", "/v1/{tail:.*}", self.proxy)

    async def start(self, host: str, port: int) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:  # fmt: skip
        if self.api_key and request.path != "/health":
            got = request.headers.get("Authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(got.encode(), expected.encode()):
                return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error",
                              code="invalid_api_key")  # fmt: skip
        resp = await handler(request)
        self.requests[resp.status] = self.requests.get(resp.status, 0) + 1
        return resp

    async def health(self, request: web.Request) -> web.Response:
        up = self.router(None)
        if isinstance(up, Upstream):
            return _json(200, {"status": "ok", "model": up.model})
        reason = up.reason if isinstance(up, Unavailable) else "no model"
        return _json(503, {"status": "unavailable", "reason": reason})

    def _model(self, name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mesh-llm"}

    async def list_models(self, request: web.Request) -> web.Response:
        return _json(200, {"object": "list", "data": [self._model(m) for m in self.models()]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.models():
            return _error(404, f"model {name!r} is not served by this mesh", "invalid_request_error",
                          code="model_not_found", param="model")  # fmt: skip
        return _json(200, self._model(name))

    async def get_metrics(self, request: web.Request) -> web.Response:
        text = self.metrics() if self.metrics else ""
        return web.Response(
            body=text.encode(), headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"}
        )

    async def mesh_status(self, request: web.Request) -> web.Response:
        return _json(200, self.status())

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/embeddings":  # llama-server would say "start it with --embeddings", not our flag
            msg = "mesh-llm serves completions and chat; embeddings are not served"
            return _error(501, msg, "invalid_request_error", code="unsupported_endpoint")
        body = await request.read()
        model: str | None = None
        if body and request.content_type == "application/json":
            try:
                parsed = json.loads(body)
            except ValueError:
                return _error(400, "request body is not valid JSON", "invalid_request_error")
            if isinstance(parsed, dict) and isinstance(parsed.get("model"), str):
                model = parsed["model"]
            need = REQUIRED.get(request.path)
            if need is not None and isinstance(parsed, dict) and not isinstance(parsed.get(need[0]), need[1]):
                return _error(400, f"'{need[0]}' is required", "invalid_request_error", param=need[0],
                              code="missing_required_parameter")  # fmt: skip
            if need is not None and self.max_tokens and isinstance(parsed, dict):
                capped = cap_tokens(parsed, self.max_tokens)
                body = body if capped is None else json.dumps(capped).encode()
        up = self.router(model)
        if up is None:
            names = ", ".join(self.models()) or "none"
            return _error(404, f"model {model!r} is not served by this mesh (served: {names})",
                          "invalid_request_error", code="model_not_found", param="model")  # fmt: skip
        if isinstance(up, Unavailable):
            return _error(503, up.reason, "unavailable", headers={"Retry-After": str(up.retry_after_s)},
                          code="model_unavailable")  # fmt: skip
        result = await self._forward(request, up, body)
        if isinstance(result, web.StreamResponse):
            return result
        # nothing reached the client yet: retry once, on whatever serves the model once the mesh has re-planned
        log.warning("%s via %s failed before any output (%s); retrying once", request.path, up.base_url, result)
        again = await self._wait_for_upstream(model)
        if isinstance(again, Upstream):
            result = await self._forward(request, again, body)
            if isinstance(result, web.StreamResponse):
                return result
        reason = again.reason if isinstance(again, Unavailable) else f"the model server failed: {result}"
        return _error(503, reason, "unavailable", headers={"Retry-After": "5"}, code="model_unavailable")

    async def _wait_for_upstream(self, model: str | None) -> Upstream | Unavailable | None:
        deadline = asyncio.get_running_loop().time() + RETRY_WAIT_S
        await asyncio.sleep(0.5)
        while True:
            up = self.router(model)
            if isinstance(up, Upstream) or up is None or asyncio.get_running_loop().time() > deadline:
                return up
            await asyncio.sleep(0.5)

    async def _forward(self, request: web.Request, up: Upstream, body: bytes) -> web.StreamResponse | str:
        """The upstream's response streamed to the client, or why it failed before anything was sent."""
        assert self._session is not None
        drop = HOP_HEADERS | {"authorization", "origin", "referer", "cookie"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        url = up.base_url + request.path_qs
        resp: web.StreamResponse | None = None
        t0 = time.monotonic()
        try:
            async with self._session.request(request.method, url, data=body or None, headers=headers) as r:
                resp = web.StreamResponse(status=r.status)
                for k, v in webguard.strip_cors(r.headers.items()):
                    if k.lower() not in HOP_HEADERS:
                        resp.headers.add(k, v)
                resp.headers.update(webguard.cors_for(request))
                await resp.prepare(request)
                sse = "event-stream" in r.headers.get("Content-Type", "")
                tally = _TokenTally(sse)
                timed = request.path in REQUIRED and r.status == 200  # completions and chats: their latency counts
                first_token: float | None = None
                held = b""  # an event's first part: sent once it is whole, so a cut never leaves half an event
                # llama-server names text completions "chatcmpl-…"; OpenAI's are "cmpl-…" (a completion body is
                # small: without SSE it is sent whole, so the rewrite never meets half a field)
                fix_id = request.path == "/v1/completions"
                try:
                    async for chunk in r.content.iter_any():
                        tally.feed(chunk)
                        if first_token is None and tally.tokens:
                            first_token = time.monotonic() - t0
                        if sse or fix_id:
                            held += chunk
                            cut = held.rfind(b"\n\n") if sse else -1
                            end = cut + 2 if cut >= 0 else 0
                            chunk, held = held[:end], held[end:]
                        if chunk:
                            await resp.write(_openai_ids(chunk) if fix_id else chunk)
                    if held:
                        await resp.write(_openai_ids(held) if fix_id else held)
                    await resp.write_eof()
                    tally.done(self.counters)
                    if timed:
                        took = time.monotonic() - t0
                        self.counters.duration.observe(took)
                        # a whole (not streamed) answer: the first token came when decoding began
                        self.counters.ttft.observe(first_token if first_token is not None else max(0.0,
                                                   took - tally.decode_s))  # fmt: skip
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    # our client went away: leaving the block closes the upstream request, which stops generating
                    log.debug("client of %s went away", request.path)
                return resp
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            log.warning("upstream %s failed: %s", up.base_url, e)
            if resp is None or not resp.prepared:
                return e.__class__.__name__
            # already streaming: end it with an error event rather than a hang or a silent cut
            try:
                if "event-stream" in resp.headers.get("Content-Type", ""):
                    err = {"error": {"message": "the model server failed mid-stream", "type": "upstream_error"}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                pass
            return resp
