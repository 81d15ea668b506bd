"""The web console: a live view of this node's status object, a chat, the invite token, agent lines, and the nodes
that asked to join from the LAN (approved with a button: ``serve/life/lan.py``).

Served on 127.0.0.1 only (even with --listen-all), to the processes of the user who started the node (Linux): it
hands out the invite token. Static files ship in the
package (no CDN). The page gets the status object over SSE whenever it changes, and chats through this server
(same origin), which forwards to the node's own API — the API itself does not open CORS to every site.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import aiohttp
from aiohttp import web
from rich.console import Console as RichConsole

from meshllm.errors import UserError
from meshllm.machine.state import load_knocks, load_token
from meshllm.proto import token as tok
from meshllm.serve.http import webguard
from meshllm.serve.life import lan

STATIC = ("console.html", "console.js", "console.css")
MAX_CHAT_TOKENS = 4096  # the console's chat box adds the API key itself: it must not pass on what a page asks
# (--max-tokens sets another cap, for the API too)
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


class Console:
    def __init__(self, status: Callable[[], dict[str, object]], state: Path, api_url: str, api_key: str | None,
                 max_tokens: int | None = None) -> None:  # fmt: skip
        self.max_tokens = max_tokens or MAX_CHAT_TOKENS
        self.status = status
        self.state = state  # the node's state dir: its invite token, the knocks waiting, the approvals
        self.api_url = api_url
        self.api_key = api_key
        self.app = web.Application(middlewares=[webguard.middleware(False, own_user_only=True)])
        self.app.router.add_get("/", self.index)
        self.app.router.add_get("/static/{name}", self.static)
        self.app.router.add_get("/events", self.events)
        self.app.router.add_get("/token", self.get_token)
        self.app.router.add_post("/chat", self.chat)
        self.app.router.add_get("/knocks", self.knocks)
        self.app.router.add_post("/approve", self.approve)
        self.app.router.add_post("/refuse", self.approve)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self, port: int) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    def _file(self, name: str) -> bytes:
        return resources.files("meshllm.serve.report").joinpath("static", name).read_bytes()

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(body=self._file("console.html"), content_type="text/html")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=self._file(name), content_type=TYPES["." + name.rsplit(".", 1)[1]])

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        last = ""
        try:
            while True:
                text = json.dumps(self.status())
                if text != last:
                    await resp.write(f"data: {text}\n\n".encode())
                    last = text
                await asyncio.sleep(0.5)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    async def knocks(self, request: web.Request) -> web.Response:
        return web.json_response({"knocks": [r for r in load_knocks(self.state) if not r.get("evicted")]})

    async def approve(self, request: web.Request) -> web.Response:
        """``mesh-llm approve NODE --scope SCOPE`` (or ``refuse NODE``) from the page: JSON only (a cross-site form
        cannot send it)."""
        if request.content_type != "application/json":
            return web.json_response({"error": "Content-Type must be application/json"}, status=415)
        try:
            got = await request.json()
            node, scope = str(got["node"]), tok.Scope.parse(str(got.get("scope", "worker")))
            if request.path == "/refuse":
                said = await asyncio.to_thread(lan.refuse, self.state, node)
            else:
                said = await asyncio.to_thread(lan.approve, self.state, node, scope)
        except (ValueError, TypeError, KeyError, AttributeError):
            return web.json_response({"error": "expected {node, scope}"}, status=400)
        except UserError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"said": said})

    async def get_token(self, request: web.Request) -> web.Response:
        t = load_token(self.state)
        if t is None:
            raise web.HTTPNotFound(text="no invite token yet")
        return web.json_response({"token": t})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        if request.content_type != "application/json":  # a cross-site form or text/plain POST needs no preflight
            return web.json_response({"error": "Content-Type must be application/json"}, status=415)
        try:
            got = await request.json()
            msgs, n = got.get("messages", []), int(got.get("max_tokens", 1024))
            temp = min(2.0, max(0.0, float(got.get("temperature", 0.7))))
        except (ValueError, TypeError, AttributeError):
            return web.json_response({"error": "expected {messages, max_tokens, temperature}"}, status=400)
        body = {"messages": msgs, "stream": True, "max_tokens": max(1, min(n, self.max_tokens)), "temperature": temp}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            async with self._session.post(f"{self.api_url}/chat/completions", json=body, headers=headers) as r:
                resp.set_status(r.status)
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
        except (aiohttp.ClientError, ConnectionError) as e:  # the API failed, or the browser went away
            if not resp.prepared:
                return web.json_response({"error": str(e)}, status=502)
        with contextlib.suppress(aiohttp.ClientConnectionResetError, ConnectionError):
            await resp.write_eof()
        return resp


async def start_console(
    port: int, status: Callable[[], dict[str, object]], state: Path, api_url: str, api_key: str | None,
    out: RichConsole, max_tokens: int | None = None,
) -> Console:  # fmt: skip
    """The web console on 127.0.0.1:``port``; one line if the port is taken."""
    web = Console(status, state, api_url, api_key, max_tokens)
    try:
        await web.start(port)
    except OSError as e:
        raise UserError(f"--console: cannot listen on 127.0.0.1:{port}: {e.strerror}") from None
    out.print(f"console: http://127.0.0.1:{port}/")
    return web
