"""What a web page in the user's browser may do with our HTTP servers (the API on :9337 and the console): nothing,
unless it is served from this machine. Browsers let any page send requests to 127.0.0.1; two headers tell us who
is asking: ``Host`` (a page that rebinds its own DNS name to 127.0.0.1 still sends its name) and ``Origin`` (sent
with every cross-origin request and every POST). Clients that are not browsers send no Origin.

- ``Host`` must name a loopback address on a loopback-only server (``--listen-all`` servers are behind the API key).
- ``Origin``, when present, must be a loopback origin (a local app, our own console); such an origin gets CORS
  headers of ours (never the upstream's, never credentials), and its preflight an answer. Any other: 403.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from meshllm.net.localuser import other_user

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _hostname(host: str) -> str:
    """The name part of a Host header value: ``[::1]:9337`` -> ``::1``, ``localhost:9337`` -> ``localhost``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_ok(host: str | None, listen_all: bool) -> bool:
    """DNS rebinding: a loopback-only server answers only requests that name a loopback host (or none)."""
    return listen_all or not host or _hostname(host) in LOOPBACK


def origin_ok(origin: str | None) -> bool:
    """A request from a web page (it carries Origin) is allowed only from a loopback origin over http(s)."""
    if origin is None:
        return True
    try:
        u = urlsplit(origin.strip())
        return u.scheme in ("http", "https") and (u.hostname or "") in LOOPBACK
    except ValueError:
        return False  # "null" (sandboxed frames, files) and garbage


def middleware(listen_all: bool, allow_headers: str = "Authorization, Content-Type",
               own_user_only: bool = False, what: str = "console") -> Middleware:  # fmt: skip
    """An aiohttp middleware applying the rules above; ``own_user_only``: clients of other users of this machine
    get 403 too (net/localuser.py)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if own_user_only and request.transport is not None and other_user(request.transport) is not None:
            msg = f"this node's {what} serves the user who started it only"
            return web.json_response({"error": {"message": msg, "type": "forbidden"}}, status=403)
        if not host_ok(request.headers.get("Host"), listen_all):
            return web.json_response({"error": {"message": "Host not allowed", "type": "forbidden"}}, status=403)
        origin = request.headers.get("Origin")
        if not origin_ok(origin):
            msg = "requests from web pages of other sites are refused"
            return web.json_response({"error": {"message": msg, "type": "forbidden"}}, status=403)
        if origin is not None and request.method == "OPTIONS":
            resp: web.StreamResponse = web.Response(status=204)
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            resp.headers["Access-Control-Allow-Headers"] = preflight_headers(allow_headers, request)
            resp.headers["Access-Control-Max-Age"] = "600"
        else:
            resp = await handler(request)
        if origin is not None and not resp.prepared:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
        return resp

    return guard


_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")


def preflight_headers(allow: str, request: web.Request) -> str:
    """The headers a preflight from a page the guard let in may send: ours, and the ones it asks for (SDKs send their
    own, such as the OpenAI JS SDK's x-stainless-*) as long as they are well-formed names, at most 32 of them."""
    asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
    have = {h.strip().lower() for h in allow.split(",")}
    extra = [h for h in asked[:32] if _TOKEN.fullmatch(h) and h.lower() not in have and h.lower() != "cookie"]
    return ", ".join([allow, *extra]) if extra else allow


def strip_cors(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """An upstream's response headers without its CORS ones (llama-server echoes any Origin, with credentials);
    repeated headers stay repeated."""
    return [(k, v) for k, v in headers if not k.lower().startswith("access-control-")]


def cors_for(request: web.Request) -> dict[str, str]:
    """Our CORS headers for a response the handler prepares itself (a stream): for an Origin the middleware let in."""
    origin = request.headers.get("Origin")
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin and origin_ok(origin) else {}
