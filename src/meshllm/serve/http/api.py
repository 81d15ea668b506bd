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
import time
from collections.abc import Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web

from meshllm.proto import resume, serving
from meshllm.serve.http import endpoints, gate, webguard
from meshllm.serve.http.answers import (
    Beat,
    TokenTally,
    error_response,
    json_response,
    openai_ids,
    replayed,
    upstream_error,
    without_role_only,
)
from meshllm.serve.http.metrics import CONTENT_TYPE, Counters
from meshllm.serve.http.slotgate import QueueFull
from meshllm.serve.http.upstream import Unavailable, Upstream, chunks

log = logging.getLogger("meshllm.api")

RETRY_WAIT_S = 60.0  # how long a failed request waits for the mesh to serve again before its one retry
RESUMES = 2  # how many times a streamed answer cut mid-way is continued on the next model server
BODY_S = 30.0  # a request's body must arrive within this long of its head
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}


Router = Callable[[str | None], Upstream | Unavailable | None]  # None: no such model


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
        self.known: Callable[[], Iterable[str]] = lambda: ()  # every name this node has seen the mesh serve
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
        for bare in endpoints.BARE:
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
            if endpoints.dot_segments(request.raw_path):
                return error_response(400, "a path with '.' or '..' segments (or an encoded slash) is refused",
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
                return error_response(401, "missing or wrong API key (Authorization: Bearer ..., or X-Api-Key: ...)",
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
            return json_response(404, {"status": "unavailable", "model": asked,
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
            return json_response(503, {"status": "unavailable", "reason": reason})
        down = next((n for n, v in states.items() if v["status"] != "ok"), None)
        body: dict[str, object] = {"status": "unavailable" if down else "ok", "model": down or next(iter(states))}
        if down is not None:  # the reason as every node gives it (503s, status): the model it is about is "model"
            body["reason"] = states[down]["reason"]
        return json_response(503 if down else 200, {**body, "models": states})

    def _model(self, name: str) -> dict[str, object]:
        info = self.model_info(name) if self.model_info is not None else None
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mesh-llm",
                **({"meshllm": info} if info else {})}  # fmt: skip

    async def list_models(self, request: web.Request) -> web.Response:
        return json_response(200, {"object": "list", "data": [self._model(m) for m in self.models()]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.models():
            return error_response(404, f"model {name!r} is not served by this mesh", "invalid_request_error",
                          code="model_not_found", param="model")  # fmt: skip
        return json_response(200, self._model(name))

    async def get_metrics(self, request: web.Request) -> web.Response:
        text = self.metrics() if self.metrics else ""
        return web.Response(
            body=text.encode(), headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"}
        )

    async def mesh_status(self, request: web.Request) -> web.Response:
        return json_response(200, self.status())

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        path = request.path if request.path.startswith("/v1/") else "/v1" + request.path  # endpoints.BARE
        ep = endpoints.ENDPOINTS.get(path)
        if ep is None:
            known = ", ".join(endpoints.ENDPOINTS)
            return error_response(404, f"unknown endpoint {request.path[:100]!r}: this API serves {known}, /v1/models",
                          "invalid_request_error", code="unknown_url")  # fmt: skip
        if request.method != "POST":
            return error_response(405, f"{request.path} takes POST", "invalid_request_error", code="method_not_allowed")
        try:
            body = await asyncio.wait_for(request.read(), BODY_S)
        except TimeoutError:
            return error_response(408, f"the request body did not arrive within {BODY_S:.0f} s",
                                  "invalid_request_error")
        got = endpoints.shape(path, ep, body, self.max_tokens, self.slot_ctx())
        if isinstance(got, endpoints.Refused):
            return error_response(400, got.message, "invalid_request_error", param=got.param, code=got.code)
        parsed, body, model = got.parsed, got.body, got.model
        if got.capped_to:
            request["capped_to"] = got.capped_to
        served = self.models()
        if model is not None and self.dropped(model):
            return error_response(404, f"model {model!r} was dropped from this mesh by its founder or an admin ("
                          f"served: "
                          f"{', '.join(served) or 'none'}; `mesh-llm serve {model[:100]}` serves it again)",
                          "invalid_request_error", code="model_not_found", param="model")  # fmt: skip
        if model is None and (model := self.default_model()) is None and len(served) > 1:
            return error_response(400, f"this mesh serves several models ({', '.join(served)}): name one in 'model'",
                          "invalid_request_error", code="model_required", param="model")  # fmt: skip
        answer = serving.answer_as(model, served, self.known()) if model is not None else None
        if isinstance(answer, serving.Gone):
            return error_response(503, answer.reason, "unavailable", headers={"Retry-After": str(answer.retry_after_s)},
                                  code="model_unavailable", param="model")  # fmt: skip
        if answer is not None and answer != model:  # the one model, asked for under another name: the answer and
            model = parsed["model"] = answer  # the body on the way to every node name the real one
            body = json.dumps(parsed).encode()
        up = self.router(model)
        if up is None:
            names = ", ".join(served) or "none"
            return error_response(404, f"model {model!r} is not served by this mesh (served: {names})",
                          "invalid_request_error", code="model_not_found", param="model")  # fmt: skip
        if isinstance(up, Unavailable):
            return error_response(503, up.reason, "unavailable", headers={"Retry-After": str(up.retry_after_s)},
                          code="model_unavailable")  # fmt: skip
        if (wrong := endpoints.kind_error(path, up.model, up.embedding)) is not None:
            return error_response(400, wrong, "invalid_request_error", code="model_not_supported", param="model")
        # the slots it takes (count_tokens: none)
        weight = endpoints.completions_asked(parsed) if ep.cap_field else int(path == endpoints.EMBEDDINGS)
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
        return error_response(503, reason, "unavailable", headers={"Retry-After": "5"}, code="model_unavailable")

    async def _resume(self, request: web.Request, path: str, resp: web.StreamResponse, body: bytes,
                      sent: TokenTally) -> bool:  # fmt: skip
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
        beat = Beat(resp)
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
                           body: dict[str, object], sent: TokenTally, replay: resume.Replay | None,
                           beat: Beat | None = None) -> bool | None:  # fmt: skip
        """The continuation's events into the client's stream (a chat's new opening event, the assistant's role
        alone, left out; with ``replay``, what the client has); True once it ended whole, None when the replay
        came out otherwise (nothing of it was sent)."""
        assert self._session is not None
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {up.key}"} if up.key else {})}
        try:
            # no slot taken here: the request still holds the one it had (our own llama-server that crashed and came
            # back has the same gate: a second hold by the same request could wait for itself)
            body = endpoints.with_stops(path, body, up.stops) or body
            async with self._session.post(up.base_url + path, data=json.dumps(body), headers=headers) as r:
                if r.status != 200 or "event-stream" not in r.headers.get("Content-Type", ""):
                    return False
                held = b""
                async for chunk in chunks(r, up):
                    held += chunk
                    cut = held.rfind(b"\n\n")
                    if cut < 0:
                        continue
                    events, held = held[: cut + 2], held[cut + 2 :]
                    events = without_role_only(events) if replay is None else replayed(events, replay)
                    if replay is not None and replay.diverged:
                        return None
                    if events:
                        await resp.write(openai_ids(events) if path == "/v1/completions" else events)
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
            return error_response(429, f"the model is busy: every slot is taken and {waiting} requests wait; retry in "
                          f"{e.retry_after_s} s", "rate_limit_error",
                          headers={"Retry-After": str(e.retry_after_s)}, code="rate_limit_exceeded")  # fmt: skip
        finally:
            self.in_flight -= 1
            if up.spread is not None:
                up.spread.end(up.node)

    async def _wait_for_upstream(self, model: str | None, deadline: float | None = None, beat: Beat | None = None
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
        url = up.base_url + path  # one of endpoints.ENDPOINTS, as matched: never the client's query or spelling
        stopped = endpoints.with_stops(path, json.loads(body), up.stops) if up.stops else None
        body = json.dumps(stopped).encode() if stopped is not None else body
        resp: web.StreamResponse | None = None
        sent: TokenTally | None = None  # a stream: what of it reached the client (whole events)
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
                    resp.headers[endpoints.CAPPED_HEADER] = str(request["capped_to"])
                await resp.prepare(request)
                sse = "event-stream" in r.headers.get("Content-Type", "")
                tally = TokenTally(sse)
                sent = TokenTally(True) if sse else None
                timed = path in endpoints.REQUIRED and r.status == 200  # completions and chats: their latency counts
                first_token: float | None = None
                held = b""  # an event's first part: sent once it is whole, so a cut never leaves half an event
                # llama-server names text completions "chatcmpl-…"; OpenAI's are "cmpl-…" (a completion body is
                # small: without SSE it is sent whole, so the rewrite never meets half a field)
                fix_id = path == "/v1/completions"
                try:
                    async for chunk in chunks(r, up):
                        tally.feed(chunk)
                        if first_token is None and tally.tokens:
                            first_token = time.monotonic() - t0
                        if sse or fix_id:
                            held += chunk
                            cut = held.rfind(b"\n\n") if sse else -1
                            end = cut + 2 if cut >= 0 else 0
                            chunk, held = held[:end], held[end:]
                        if chunk:
                            await resp.write(openai_ids(chunk) if fix_id else chunk)
                            if sent is not None:
                                sent.feed(chunk)
                    if held:
                        await resp.write(openai_ids(held) if fix_id else held)
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
