"""The OpenAI-compatible API on :9337 that every node serves.

Requests go to an upstream chosen by the request's ``model`` field: the local llama-server on the host, or (on
other nodes) a tunnel to the host. Responses are streamed through as they come, so SSE arrives
token by token. With no upstream yet the answer is 503 with a JSON body that says why.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from meshllm.proto import resume
from meshllm.proto.fleet import Spread
from meshllm.serve.http import gate, webguard
from meshllm.serve.http.metrics import CONTENT_TYPE, Counters
from meshllm.serve.http.slotgate import QueueFull, SlotGate

log = logging.getLogger("meshllm.api")

RETRY_WAIT_S = 60.0  # how long a failed request waits for the mesh to serve again before its one retry
RESUMES = 2  # how many times a streamed answer cut mid-way is continued on the next model server
KEEPALIVE_S = 2.0  # while a cut answer waits and is continued, the client gets an SSE comment at least this often
KEEPALIVE = b": mesh-llm: continuing the answer on another model server\n\n"  # SSE comment: clients skip it
BODY_S = 30.0  # a request's body must arrive within this long of its head
QUIET_S = 1.0  # an answer that brings nothing for this long asks whether its host is still alive (``Upstream.alive``)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}


@dataclass(frozen=True)
class Upstream:
    """Where a model is served: an HTTP base URL reachable from this process (a local port or a tunnel)."""

    model: str
    base_url: str
    key: str | None = None  # llama-server's own key (a local one); None: the upstream takes none (a host's door)
    slots: SlotGate | None = None  # our own llama-server's slots: completions wait there for one (None: another node's)
    node: bytes = b""  # the node that serves it (a replica or the elected host: ``spread`` counts its requests)
    spread: Spread | None = None
    alive: Callable[[], bool] | None = None  # another node's: whether the mesh still hears from it
    stops: tuple[str, ...] = ()  # our own llama-server's: stop strings every chat to it gets (a base model's turns)
    embedding: bool | None = None  # our own: whether it is an embedding model (None: another node's: its door knows)


async def _chunks(r: aiohttp.ClientResponse, up: Upstream) -> AsyncIterator[bytes]:
    """The response's bytes as they come; ConnectionError once it has been quiet QUIET_S and the node serving it
    has gone silent (killed: its tunnel would say so only when the mesh declares it dead, seconds later)."""
    while True:
        try:
            chunk = await (asyncio.wait_for(r.content.readany(), QUIET_S) if up.alive else r.content.readany())
        except TimeoutError:
            if up.alive is not None and not up.alive():
                raise ConnectionError("the node serving it went silent") from None
            continue
        if not chunk:
            return
        yield chunk


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
        self.text: list[str] = []  # the generated text, piece by piece (SSE)
        self.finished = False  # an event said why the answer ended (its finish_reason)

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
                self.text.append(str(piece))
            self.finished = self.finished or bool(ch.get("finish_reason"))
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
    extra: dict[str, object] | None = None,
) -> web.Response:
    """An error in OpenAI's shape: ``code`` a string such as "model_not_found" (or null), ``param`` the field at
    fault (or null); what the SDKs read into their exceptions. ``extra``: more fields of the error object."""
    err = {**(extra or {}), "message": message, "type": kind, "param": param, "code": code}
    return _json(status, {"error": err}, headers)


# what each endpoint cannot do without (llama-server's own answer would leak its JSON library's exception text)
REQUIRED = {"/v1/completions": ("prompt", (str, list)), "/v1/chat/completions": ("messages", (list,)),
            "/v1/embeddings": ("input", (str, list))}  # fmt: skip


# every name a request may ask for a number of tokens under: OpenAI's two, llama-server's own, the Responses API's
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
_OPENAI = frozenset({"max_tokens", "max_completion_tokens", "n_predict"})  # llama-server takes each of them here


@dataclass(frozen=True)
class Endpoint:
    """One of llama-server's endpoints that the API passes on (POST only): the fields llama-server reads the number
    of tokens to generate from there, and the one --max-tokens writes (None: it generates nothing)."""

    honoured: frozenset[str] = frozenset()
    cap_field: str | None = None


# the only paths passed on to llama-server; every other path under /v1 is 404 here, so llama-server's own endpoints
# (/slots, /props, /metrics, /v1/chat/completions/control, ...) are never reachable through the API
ENDPOINTS = {
    "/v1/chat/completions": Endpoint(_OPENAI, "max_tokens"),
    "/v1/completions": Endpoint(_OPENAI, "max_tokens"),
    "/v1/messages": Endpoint(frozenset({"max_tokens"}), "max_tokens"),  # llama-server reads max_tokens only
    # llama-server turns max_output_tokens into max_tokens and passes every other field through: all are honoured
    "/v1/responses": Endpoint(frozenset(TOKEN_FIELDS), "max_output_tokens"),
    "/v1/messages/count_tokens": Endpoint(),
    "/v1/embeddings": Endpoint(),  # an embedding model's (see ``kind_error``)
}
EMBEDDINGS = "/v1/embeddings"


BARE = ("/chat/completions", "/completions", "/embeddings")  # served as under /v1 (OpenAI's shape)


def kind_error(path: str, model: str, embedding: bool | None) -> str | None:
    """Why ``path`` cannot go to ``model`` — embeddings from a model that makes text, text from an
    embedding model — or None (also when the model's kind is not known here: its host's door says)."""
    if embedding is None or (path == EMBEDDINGS) == embedding:
        return None
    if embedding:
        return f"model {model!r} is an embedding model: it answers {EMBEDDINGS} only"
    return f"model {model!r} makes text, not embeddings: {EMBEDDINGS} needs an embedding model (one whose GGUF pools)"


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def cap_tokens(req: dict[str, object], cap: int, ep: Endpoint = ENDPOINTS["/v1/completions"]
               ) -> dict[str, object] | None:  # fmt: skip
    """A request to ``ep`` that could generate more than ``cap`` tokens (it asks for more under any name, or asks
    under no name ``ep`` honours: until the context is full) made to ask for at most ``cap`` under the one name that
    endpoint honours; None when it already does (or ``ep`` generates nothing)."""
    if ep.cap_field is None:
        return None
    asked = [req[f] for f in TOKEN_FIELDS if f in req]
    if any(f in req for f in ep.honoured) and all(_count(n) and n <= cap for n in asked):  # type: ignore[operator]
        return None
    n = min((v for v in asked if _count(v) and v <= cap), default=cap)  # type: ignore[type-var, operator]
    return {**{k: v for k, v in req.items() if k not in TOKEN_FIELDS}, ep.cap_field: n}


CAPPED_HEADER = "X-Mesh-Max-Tokens"  # on an answer whose request asked for more tokens than its slot holds


def over_context(req: dict[str, object], ctx: int) -> bool:
    """Whether a request asks for more tokens than a slot of ``ctx`` tokens holds, under any name."""
    return any(_count(n) and n > ctx for n in (req.get(f) for f in TOKEN_FIELDS))  # type: ignore[operator]


def _completions(req: dict[str, object]) -> int:
    """How many completions a request asks for (``n``, llama-server's ``n_cmpl``): each takes a slot."""
    n = req.get("n_cmpl", req.get("n", 1))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


DEFAULT_TOKENS = 4096  # what a request that does not say how many tokens gets, when --max-tokens sets no cap


def default_tokens(req: dict[str, object], ep: Endpoint) -> dict[str, object] | None:
    """A request to ``ep`` that says under no name ``ep`` honours how many tokens to generate, made to ask for
    DEFAULT_TOKENS (else llama-server generates until the slot's context is full: a base model never stops); None
    when it says (or ``ep`` generates nothing)."""
    if ep.cap_field is None or any(req.get(f) is not None for f in ep.honoured):
        return None
    return {**{k: v for k, v in req.items() if k not in ep.honoured}, ep.cap_field: DEFAULT_TOKENS}


# where a chat names its stops (llama-server's /v1/responses takes "stop" too, though OpenAI's has none)
STOP_FIELDS = {"/v1/chat/completions": "stop", "/v1/messages": "stop_sequences", "/v1/responses": "stop"}


def with_stops(path: str, req: dict[str, object], stops: tuple[str, ...]) -> dict[str, object] | None:
    """A chat to ``path`` with ``stops`` added to the stop strings it names itself; None when it has them all, is
    not a chat, or names its stops in a shape llama-server refuses (it answers the error)."""
    field = STOP_FIELDS.get(path)
    have = req.get(field) if field else None
    mine = [] if have is None else [have] if isinstance(have, str) else have if isinstance(have, list) else None
    more = [s for s in stops if mine is not None and s not in mine]
    return {**req, field: [*(mine or []), *more]} if field and more else None


def dot_segments(raw_path: str) -> bool:
    """Whether a request's path (as sent, before any decoding) has a '.' or '..' segment, plain or percent-encoded,
    or an encoded slash or backslash that could make one: such paths are refused, never normalised and passed on."""
    path = raw_path.split("?", 1)[0]
    low = path.lower()
    if "%2f" in low or "%5c" in low or "\\" in path:
        return True
    return any(urllib.parse.unquote(urllib.parse.unquote(seg)) in (".", "..") for seg in path.split("/"))


_JSON_LIB = re.compile(r"\s*\[json\.exception\.[\w.]+\]")  # llama-server's JSON library speaking
_FIELD = re.compile(r"^Field '([\w.]{1,64})'")


def upstream_error(status: int, body: bytes, retry_after: str | None = None) -> web.Response:
    """llama-server's error (``{"error": {"code": 400, "message": ..., "type": ...}}``) in OpenAI's shape, as the
    API's own errors are: ``code`` a string or null, ``param`` the field at fault (or null), its JSON library's
    exception names left out of the message; its other fields kept (``n_prompt_tokens`` and ``n_ctx``
    of a context overflow), and ``retry_after`` (the host's 429 or 503 through a lite client) kept as Retry-After."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict):
        return _error(status, body.decode(errors="replace")[:500] or f"the model server answered {status}",
                      "upstream_error")  # fmt: skip
    msg = _JSON_LIB.sub("", str(err.get("message") or f"the model server answered {status}"))
    field = _FIELD.match(msg)
    code = err.get("code")
    extra: dict[str, object] = {k: v for k, v in err.items() if k not in ("message", "type", "code", "param")
                                and isinstance(k, str) and (v is None or isinstance(v, int | float | str | bool))}
    wait = {"Retry-After": retry_after} if retry_after and retry_after.isdigit() else None
    return _error(status, msg, str(err.get("type") or "invalid_request_error"), wait,
                  code=code if isinstance(code, str) else None, param=field.group(1) if field else None, extra=extra)


def _without_role_only(events: bytes) -> bytes:
    """SSE events less a chat's opening event that carries only the assistant's role (a continued answer's second
    opening: the client already had one)."""
    keep = []
    for ev in events.split(b"\n\n"):
        if ev.startswith(b"data: {") and b'"role":"assistant"' in ev:
            try:
                ch = (json.loads(ev[6:]).get("choices") or [{}])[0]
            except (ValueError, AttributeError, IndexError):
                ch = {}
            delta = ch.get("delta") or {}
            if not delta.get("content") and not ch.get("finish_reason") and not delta.get("tool_calls"):
                continue
        keep.append(ev)
    return b"\n\n".join(keep)


def _replayed(events: bytes, replay: resume.Replay) -> bytes:
    """SSE events of an answer generated again, as ``replay`` lets them through."""
    out = []
    for ev in events.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            try:
                obj = json.loads(ev[6:])
            except ValueError:
                continue
            kept = replay.event(obj) if isinstance(obj, dict) else None
            if kept is not None:
                out.append(b"data: " + json.dumps(kept, separators=(",", ":")).encode() + b"\n\n")
        elif ev.strip():
            out.append(ev + b"\n\n")
    return b"".join(out)


def _openai_ids(body: bytes) -> bytes:
    return body.replace(b'"id":"chatcmpl-', b'"id":"cmpl-')


class _Beat:
    """A client's stream kept alive while its cut answer waits for the mesh and is replayed — an SSE
    comment (which clients skip) once ``KEEPALIVE_S`` passed without a byte; a client or proxy with a read timeout
    does not end the answer that is about to go on."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.last = time.monotonic()

    def wrote(self) -> None:
        self.last = time.monotonic()

    async def tick(self) -> None:
        if time.monotonic() - self.last >= KEEPALIVE_S:
            await self.resp.write(KEEPALIVE)
            self.wrote()


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
        door: bool = False,
        source_of: Callable[[int], str] | None = None,
        slot_ctx: Callable[[], int | None] = lambda: None,
        default_model: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``door``: the host's door for requests its peers forward over the mesh (loopback, our own user only, no
        API key: the peer is an authenticated member) — the same endpoints and the same --max-tokens as the API,
        so no member reaches llama-server's own endpoints or generates past the cap by skipping its own API."""
        self.router = router
        self.default_model = default_model  # a request naming no model is for this one (None: ask)
        self.door = door
        self.source_of = source_of  # the door: whose request a connection (by its client port) carries
        self.max_tokens = max_tokens  # --max-tokens: the most a completion request may ask for (None: no cap)
        self.slot_ctx = slot_ctx  # the context of a slot of the llama-server behind us, when we run it
        self.metrics = metrics
        self.counters = Counters()
        self.models = models
        self.model_info: Callable[[str], dict[str, object] | None] | None = None  # a model's host and nodes
        self.dropped: Callable[[str], bool] = lambda name: False  # whether `mesh-llm drop` dropped a model
        self.status = status
        self.api_key = api_key
        self.requests: dict[int, int] = {}
        self.in_flight = 0  # requests passed on (or waiting for a slot) now
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        # connections before the key is checked (serve/http/gate.py); one address's share only where other machines can
        # connect (--listen-all): on loopback every client shares 127.0.0.1 (a local swarm of agents, the door)
        self.limits = gate.ConnLimits(per_address=gate.PER_ADDRESS if listen_all else gate.TOTAL)
        self._gates: dict[object, gate.Gate] = {}
        # web pages of other sites, DNS rebinding (serve/http/webguard.py); the door: other users of this machine too
        guard = webguard.middleware(listen_all, own_user_only=door, what="mesh door")
        chain = [self._paths, guard] if door else [self._paths, guard, self._auth]
        self.app = web.Application(middlewares=chain, client_max_size=64 << 20)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_get("/v1/models/{model:.+}", self.get_model)
        self.app.router.add_get("/models", self.list_models)  # many clients leave /v1 out of their base URL
        for bare in BARE:
            self.app.router.add_route("*", bare, self.proxy)
        self.created = int(time.time())  # the models' "created" (OpenAI's model objects carry one)
        self.app.router.add_get("/mesh/status", self.mesh_status)
        self.app.router.add_get("/metrics", self.get_metrics)
        self.app.router.add_route("*", "/v1/{tail:.*}", self.proxy)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); the port."""
        # a connection per request: llama-server's HTTP server closes a connection after a streamed answer without
        # saying so, and one reused just then failed its request before any byte ("Server disconnected", "Can not
        # write request body": 8 of 96 streamed requests, 16 at a time on 4 slots)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              connector=aiohttp.TCPConnector(force_close=True))  # fmt: skip
        # a client that goes away cancels its handler: leaving the upstream request stops llama-server generating
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        assert self._runner.server is not None
        gate.raise_file_limit()
        # every connection passes the gate first: bounded per address and in all, its request head within a deadline
        factory = gate.gated(self.limits, self._runner.server, self._gates)
        self._listener = await asyncio.get_running_loop().create_server(factory, host, port, reuse_address=True)
        return int(self._listener.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._listener:
            self._listener.close()
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    @web.middleware
    async def _paths(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:  # fmt: skip
        g = self._gates.get(request.transport)
        if g is not None:
            g.started()  # its head is in: the slow-client deadline stops (the body has BODY_S)
            if not self.api_key:
                g.proven()  # no key to present: a whole head is all a connection can show
        try:
            if dot_segments(request.raw_path):
                return _error(400, "a path with '.' or '..' segments (or an encoded slash) is refused",
                              "invalid_request_error", code="invalid_path")  # fmt: skip
            return await handler(request)
        finally:
            if g is not None:
                g.finished()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:  # fmt: skip
        if self.api_key and request.path != "/health":
            # OpenAI's clients send "Authorization: Bearer KEY", Anthropic's "X-Api-Key: KEY": either will do
            bearer = request.headers.get("Authorization", "").encode()
            x_key = request.headers.get("X-Api-Key", "").encode()
            ok_bearer = hmac.compare_digest(bearer, f"Bearer {self.api_key}".encode())
            if not (ok_bearer | hmac.compare_digest(x_key, self.api_key.encode())):
                return _error(401, "missing or wrong API key (Authorization: Bearer ..., or X-Api-Key: ...)",
                              "authentication_error", code="invalid_api_key")  # fmt: skip
            g = self._gates.get(request.transport)
            if g is not None:
                g.proven()  # it presented the key: never closed to make room for a stranger's
        resp = await handler(request)
        if request.match_info.handler == self.proxy:  # what clients asked of the model: not probes of /health, ...
            self.requests[resp.status] = self.requests.get(resp.status, 0) + 1
        return resp

    async def health(self, request: web.Request) -> web.Response:
        """``?model=NAME`` that model's state; else every model this node serves or routes (its own and
        each the mesh serves), "ok" only when every one of them answers, and each one's state under its name."""
        asked = request.query.get("model")
        if asked is not None and asked not in self.models():
            return _json(404, {"status": "unavailable", "model": asked,
                               "reason": f"not served by this mesh (served: {', '.join(self.models()) or 'none'})"})
        names = [asked] if asked is not None else list(dict.fromkeys([*filter(None, [self.default_model()]),
                                                                       *self.models()]))  # fmt: skip
        states: dict[str, dict[str, str]] = {}
        for name in names:
            up = self.router(name)
            states[name] = {"status": "ok"} if isinstance(up, Upstream) else {
                "status": "unavailable", "reason": up.reason if isinstance(up, Unavailable) else "not served"}
        if not states:
            up = self.router(None)
            reason = up.reason if isinstance(up, Unavailable) else "no model"
            return _json(503, {"status": "unavailable", "reason": reason})
        down = next((n for n, v in states.items() if v["status"] != "ok"), None)
        body: dict[str, object] = {"status": "unavailable" if down else "ok", "model": down or next(iter(states))}
        if down is not None:  # the reason as every node gives it (503s, status): the model it is about is "model"
            body["reason"] = states[down]["reason"]
        return _json(503 if down else 200, {**body, "models": states})

    def _model(self, name: str) -> dict[str, object]:
        info = self.model_info(name) if self.model_info is not None else None
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mesh-llm",
                **({"meshllm": info} if info else {})}  # fmt: skip

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
        path = request.path if request.path.startswith("/v1/") else "/v1" + request.path  # BARE
        ep = ENDPOINTS.get(path)
        if ep is None:
            known = ", ".join(ENDPOINTS)
            return _error(404, f"unknown endpoint {request.path[:100]!r}: this API serves {known}, /v1/models",
                          "invalid_request_error", code="unknown_url")  # fmt: skip
        if request.method != "POST":
            return _error(405, f"{request.path} takes POST", "invalid_request_error", code="method_not_allowed")
        try:
            body = await asyncio.wait_for(request.read(), BODY_S)
        except TimeoutError:
            return _error(408, f"the request body did not arrive within {BODY_S:.0f} s", "invalid_request_error")
        try:  # whatever its Content-Type says: llama-server parses every body as JSON
            parsed = json.loads(body)
        except ValueError:
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(parsed, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        model = parsed["model"] if isinstance(parsed.get("model"), str) else None
        need = REQUIRED.get(path)
        if need is not None and not isinstance(parsed.get(need[0]), need[1]):
            return _error(400, f"'{need[0]}' is required", "invalid_request_error", param=need[0],
                          code="missing_required_parameter")  # fmt: skip
        bad = next((f for f in TOKEN_FIELDS if parsed.get(f) is not None and not _count(parsed[f])), None)
        if bad is not None:
            return _error(400, f"'{bad}' must be a positive whole number", "invalid_request_error", param=bad,
                          code="invalid_value")  # fmt: skip
        capped = cap_tokens(parsed, self.max_tokens, ep) if self.max_tokens else default_tokens(parsed, ep)
        if capped is not None:
            parsed = capped
            body = json.dumps(capped).encode()
        ctx = self.slot_ctx()
        if ctx and over_context(parsed, ctx) and (fit := cap_tokens(parsed, ctx, ep)) is not None:
            # more than a slot holds (max_tokens 10,000,000 was taken): as many as it holds, and a header
            # says so (the door's answer carries it back through every node)
            parsed, body = fit, json.dumps(fit).encode()
            request["capped_to"] = ctx
        served = self.models()
        if model is not None and self.dropped(model):
            return _error(404, f"model {model!r} was dropped from this mesh by its founder or an admin (served: "
                          f"{', '.join(served) or 'none'}; `mesh-llm serve {model[:100]}` serves it again)",
                          "invalid_request_error", code="model_not_found", param="model")  # fmt: skip
        if model is None and (model := self.default_model()) is None and len(served) > 1:
            return _error(400, f"this mesh serves several models ({', '.join(served)}): name one in 'model'",
                          "invalid_request_error", code="model_required", param="model")  # fmt: skip
        if model is not None and model not in served and len(served) == 1:
            # one model served: any name reaches it (clients configured for another name work, as with
            # llama-server); the answer names the real one, and the body says it to every node on the way
            model = parsed["model"] = served[0]
            body = json.dumps(parsed).encode()
        up = self.router(model)
        if up is None:
            names = ", ".join(served) or "none"
            return _error(404, f"model {model!r} is not served by this mesh (served: {names})",
                          "invalid_request_error", code="model_not_found", param="model")  # fmt: skip
        if isinstance(up, Unavailable):
            return _error(503, up.reason, "unavailable", headers={"Retry-After": str(up.retry_after_s)},
                          code="model_unavailable")  # fmt: skip
        if (wrong := kind_error(path, up.model, up.embedding)) is not None:
            return _error(400, wrong, "invalid_request_error", code="model_not_supported", param="model")
        weight = _completions(parsed) if ep.cap_field else int(path == EMBEDDINGS)  # slots (count_tokens: none)
        result = await self._held(request, path, up, body, weight)
        if isinstance(result, web.StreamResponse):
            return result
        # nothing reached the client yet: retry once, on whatever serves the model once the mesh has re-planned
        log.warning("%s via %s failed before any output (%s); retrying once", request.path, up.base_url, result)
        again = await self._wait_for_upstream(model)
        if isinstance(again, Upstream):
            result = await self._held(request, path, again, body, weight)
            if isinstance(result, web.StreamResponse):
                return result
        reason = again.reason if isinstance(again, Unavailable) else f"the model server failed: {result}"
        return _error(503, reason, "unavailable", headers={"Retry-After": "5"}, code="model_unavailable")

    async def _resume(self, request: web.Request, path: str, resp: web.StreamResponse, body: bytes,
                      sent: _TokenTally) -> bool:  # fmt: skip
        """A streamed answer whose model server failed mid-way, continued where it was cut on whatever serves the
        model once the mesh has re-planned (``proto/resume.py``); False when it cannot be (then the stream ends with
        an error event)."""
        try:
            parsed = json.loads(body)
        except ValueError:
            return False
        model = parsed.get("model") if isinstance(parsed.get("model"), str) else None
        loop = asyncio.get_running_loop()
        deadline, cuts = loop.time() + RETRY_WAIT_S, 0  # each cut its own wait (see below)
        beat = _Beat(resp)
        while cuts < RESUMES:
            text = "".join(sent.text)
            more = resume.continuation(path, parsed, text, sent.tokens)
            if more is None or sent.finished:
                return False
            try:
                up = await self._wait_for_upstream(model, deadline, beat)
            except ConnectionError:  # the client went away while its answer waited: nothing left to send it
                return True
            if not isinstance(up, Upstream):
                return False
            log.warning("%s cut after %d tokens: continuing on %s", path, sent.tokens, up.base_url)
            # the answer again from its start, less what the client has (the uninterrupted text); where it comes
            # out otherwise, or it is long (resume.replays), the prompt extended by the text instead
            before = sent.tokens
            done: bool | None = None
            if resume.replays(sent.tokens):
                replay = resume.Replay(text, chat=path == resume.CHAT)
                done = await self._stream_more(request, path, resp, up, parsed, sent, replay, beat)
                if done is None:
                    log.warning("%s: the answer came out otherwise on %s; continuing its prompt", path, up.base_url)
            if done is None:
                done = await self._stream_more(request, path, resp, up, more, sent, None, beat)
            if done:
                return True
            if up.spread is not None:  # the next try goes to another host of the model while one serves
                up.spread.fail(up.node, time.monotonic())
            # a server that gave nothing new (not ready yet: a host whose llama-server restarts) is tried again
            # until the deadline; one that failed after giving more is a new cut, and cuts are counted
            if sent.tokens > before or loop.time() > deadline:
                cuts += 1
                deadline = loop.time() + RETRY_WAIT_S  # the next cut waits as long as the first
        return False

    async def _stream_more(self, request: web.Request, path: str, resp: web.StreamResponse, up: Upstream,
                           body: dict[str, object], sent: _TokenTally, replay: resume.Replay | None,
                           beat: _Beat | None = None) -> bool | None:  # fmt: skip
        """The continuation's events into the client's stream (a chat's new opening event, the assistant's role
        alone, left out; with ``replay``, what the client has); True once it ended whole, None when the replay
        came out otherwise (nothing of it was sent)."""
        assert self._session is not None
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {up.key}"} if up.key else {})}
        try:
            # no slot taken here: the request still holds the one it had (our own llama-server that crashed and came
            # back has the same gate: a second hold by the same request could wait for itself)
            body = with_stops(path, body, up.stops) or body
            async with self._session.post(up.base_url + path, data=json.dumps(body), headers=headers) as r:
                if r.status != 200 or "event-stream" not in r.headers.get("Content-Type", ""):
                    return False
                held = b""
                async for chunk in _chunks(r, up):
                    held += chunk
                    cut = held.rfind(b"\n\n")
                    if cut < 0:
                        continue
                    events, held = held[: cut + 2], held[cut + 2 :]
                    events = _without_role_only(events) if replay is None else _replayed(events, replay)
                    if replay is not None and replay.diverged:
                        return None
                    if events:
                        await resp.write(_openai_ids(events) if path == "/v1/completions" else events)
                        sent.feed(events)
                        if beat is not None:
                            beat.wrote()
                    elif beat is not None:  # the replay of what the client has: it hears that the answer goes on
                        await beat.tick()
                await resp.write_eof()
                return True
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            log.warning("continuing %s on %s failed: %s", path, up.base_url, e)
            return False

    def _source(self, request: web.Request) -> str:
        """Who asks, for the fair share of slots: the member a door connection speaks for, else the client as the
        gate counts it (``gate.client_of``: its network, or the local user on loopback) — one client from many
        addresses is one."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if self.source_of is not None and peer:
            return self.source_of(int(peer[1]))
        g = self._gates.get(request.transport)
        if g is not None and g.client:
            return f"client {g.client}"
        return f"client {gate.client_of(str(peer[0])) if peer else '?'}"

    async def _held(self, request: web.Request, path: str, up: Upstream, body: bytes, weight: int
                    ) -> web.StreamResponse | str:  # fmt: skip
        """``_forward`` once the request has its slots on our own llama-server (another node's: that node's door
        holds them); 429 with Retry-After when every slot is busy and the queue is full."""
        self.in_flight += 1
        if up.spread is not None:
            up.spread.begin(up.node)
        try:
            if up.slots is None or not weight:
                return await self._forward(request, path, up, body)
            async with up.slots.hold(self._source(request), weight):
                return await self._forward(request, path, up, body)
        except QueueFull as e:
            waiting = up.slots.core.queue_max if up.slots else 0
            return _error(429, f"the model is busy: every slot is taken and {waiting} requests wait; retry in "
                          f"{e.retry_after_s} s", "rate_limit_error",
                          headers={"Retry-After": str(e.retry_after_s)}, code="rate_limit_exceeded")  # fmt: skip
        finally:
            self.in_flight -= 1
            if up.spread is not None:
                up.spread.end(up.node)

    async def _wait_for_upstream(self, model: str | None, deadline: float | None = None, beat: _Beat | None = None
                                 ) -> Upstream | Unavailable | None:  # fmt: skip
        """What serves ``model`` once something does, or the last answer at the deadline; ``beat``: a stream kept
        alive meanwhile."""
        deadline = deadline or asyncio.get_running_loop().time() + RETRY_WAIT_S
        await asyncio.sleep(0.5)
        while True:
            up = self.router(model)
            if isinstance(up, Upstream) or up is None or asyncio.get_running_loop().time() > deadline:
                return up
            if beat is not None:
                await beat.tick()
            await asyncio.sleep(0.5)

    async def _forward(self, request: web.Request, path: str, up: Upstream, body: bytes) -> web.StreamResponse | str:
        """The upstream's response streamed to the client, or why it failed before anything was sent."""
        assert self._session is not None
        drop = HOP_HEADERS | {"authorization", "x-api-key", "origin", "referer", "cookie"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop | {"content-type"}}
        headers["Content-Type"] = "application/json"  # what the body is: it was parsed as JSON
        if up.key:
            headers["Authorization"] = f"Bearer {up.key}"
        url = up.base_url + path  # one of ENDPOINTS, as matched: never the client's query or spelling
        stopped = with_stops(path, json.loads(body), up.stops) if up.stops else None
        body = json.dumps(stopped).encode() if stopped is not None else body
        resp: web.StreamResponse | None = None
        sent: _TokenTally | None = None  # a stream: what of it reached the client (whole events)
        t0 = time.monotonic()
        try:
            async with self._session.request(request.method, url, data=body or None, headers=headers) as r:
                if r.status >= 400 and "json" in r.headers.get("Content-Type", ""):
                    # one shape for every error the API answers
                    return upstream_error(r.status, await r.read(), r.headers.get("Retry-After"))
                resp = web.StreamResponse(status=r.status)
                for k, v in webguard.strip_cors(r.headers.items()):
                    if k.lower() not in HOP_HEADERS:
                        resp.headers.add(k, v)
                resp.headers.update(webguard.cors_for(request))
                if request.get("capped_to"):
                    resp.headers[CAPPED_HEADER] = str(request["capped_to"])
                await resp.prepare(request)
                sse = "event-stream" in r.headers.get("Content-Type", "")
                tally = _TokenTally(sse)
                sent = _TokenTally(True) if sse else None
                timed = path in REQUIRED and r.status == 200  # completions and chats: their latency counts
                first_token: float | None = None
                held = b""  # an event's first part: sent once it is whole, so a cut never leaves half an event
                # llama-server names text completions "chatcmpl-…"; OpenAI's are "cmpl-…" (a completion body is
                # small: without SSE it is sent whole, so the rewrite never meets half a field)
                fix_id = path == "/v1/completions"
                try:
                    async for chunk in _chunks(r, up):
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
                            if sent is not None:
                                sent.feed(chunk)
                    if held:
                        await resp.write(_openai_ids(held) if fix_id else held)
                    tally.done(self.counters)  # before the end goes out: a client that has it all sees it counted
                    await resp.write_eof()
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
            if up.spread is not None:  # its requests go to another host of the model while one serves
                up.spread.fail(up.node, time.monotonic())
            if resp is None or not resp.prepared:
                return e.__class__.__name__
            if self.door and request.transport is not None:
                # cut the peer's stream short instead of continuing here: the node its client asked sees the cut and
                # continues the answer on whatever serves the model — a replica at once, not only our llama-server
                # once it is back (that node's router sees the whole mesh, ours only our own llama-server)
                request.transport.abort()
                return resp
            if sent is not None and await self._resume(request, path, resp, body, sent):
                return resp  # continued on whatever serves the model now: one stream, no error
            # already streaming: end it with an error event rather than a hang or a silent cut
            try:
                if "event-stream" in resp.headers.get("Content-Type", ""):
                    err = {"error": {"message": "the model server failed mid-stream", "type": "upstream_error"}}
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                pass
            return resp
