"""FAKE: a local stand-in for the Hugging Face hub (the one boundary these machines cannot reach).

It behaves like the hub where huggingface_hub's downloads and our catalog check depend on it:

- ``HEAD/GET /{org}/{repo}/resolve/{revision}/{file}`` of an LFS file answers **302 to another origin** (the CDN,
  a second listener on another port), with ``X-Repo-Commit``, ``X-Linked-Etag`` (the LFS sha256),
  ``X-Linked-Size`` and an ``ETag`` that is the git blob id of the LFS pointer, not the sha256 — as the hub does.
- The CDN serves the bytes with byte ranges and its own ETag, and records whether an ``Authorization`` header
  reached it (the hub's token must never leave the hub's origin).
- Gated repositories need ``Authorization: Bearer <token>`` with a token in ``tokens``: none → 401 ``GatedRepo``,
  an unknown token → 401 (invalid credentials), a known one without access → 403 ``GatedRepo``.
- ``POST /api/models/{org}/{repo}/paths-info/{revision}`` lists sizes, blob ids and LFS sha256s (``--check``).
- Errors carry the hub's ``X-Error-Code`` (``RepoNotFound``, ``EntryNotFound``, ``GatedRepo``).

Not served: the Xet storage path. The hub answers Xet-backed files with ``X-Xet-Hash`` and a token-refresh
route, and hf-xet (a compiled client) then talks to Xet's CAS service in its own chunked, deduplicated format;
standing that service up here would mean writing a second Xet server. Without ``X-Xet-Hash`` the installed hf-xet
stays idle and huggingface_hub takes the HTTP path below, which is what a hub without Xet does.

Faults on demand (per file): cut the connection after ``cut_after`` bytes on the first GET, fail later GETs with
503 (``fail_after_cut``), or serve corrupted bytes on the first GET (``corrupt_once``).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubFile:
    data: bytes = b""
    declared_size: int | None = None  # listed with this size but never downloaded (catalog checks)
    cut_after: int | None = None  # the first GET drops the connection after this many bytes
    fail_after_cut: bool = False  # GETs after the cut answer 503 (the hub is down for a while)
    corrupt_once: bool = False  # the first GET serves different bytes
    gets: list[str] = field(default_factory=list)  # the Range header of every GET ("" for none)

    @property
    def size(self) -> int:
        return self.declared_size if self.declared_size is not None else len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        """The git blob id of the LFS pointer file: what the hub sends as the resolve ETag."""
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()
        return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()


@dataclass
class HubStandin:
    files: dict[str, HubFile] = field(default_factory=dict)  # "org/repo/file" -> content
    gated: dict[str, set[str]] = field(default_factory=dict)  # "org/repo" -> tokens granted access
    tokens: set[str] = field(default_factory=set)  # tokens the hub knows
    port: int = 0
    cdn_port: int = 0
    cdn_saw_authorization: int = 0  # requests that reached the CDN carrying an Authorization header
    resolves: int = 0  # file requests (resolve) the hub answered, any file
    sent: int = 0  # bytes of files the CDN sent, all files and requests together

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            hub = web.Application()
            hub.router.add_route("*", "/{org}/{repo}/resolve/{rev}/{path:.+}", self.resolve)
            hub.router.add_post("/api/models/{org}/{repo}/paths-info/{rev}", self.paths_info)
            cdn = web.Application()
            cdn.router.add_get("/blobs/{sha}", self.blob)
            self.port = self.loop.run_until_complete(self._serve(hub))
            self.cdn_port = self.loop.run_until_complete(self._serve(cdn))
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        if not ready.wait(10):
            raise RuntimeError("hub stand-in did not start")

    async def _serve(self, app: web.Application) -> int:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runners = [*getattr(self, "_runners", []), runner]
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def stop(self) -> None:
        """The hub goes away (its ports close)."""

        async def down() -> None:
            for r in self._runners:
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _refused(self, request: web.Request, repo: str) -> web.Response | None:
        if repo not in self.gated:
            return None
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        if token is None:
            return web.Response(status=401, headers={"X-Error-Code": "GatedRepo"}, text="authenticate to access")
        if token not in self.tokens:
            return web.Response(status=401, text="Invalid credentials in Authorization header")
        if token not in self.gated[repo]:
            return web.Response(status=403, headers={"X-Error-Code": "GatedRepo"}, text="access not granted")
        return None

    def _missing(self, repo: str) -> web.Response:
        code = "EntryNotFound" if any(k.startswith(repo + "/") for k in self.files) else "RepoNotFound"
        return web.Response(status=404, headers={"X-Error-Code": code}, text="not found")

    async def resolve(self, request: web.Request) -> web.Response:
        self.resolves += 1
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        refused = self._refused(request, repo)
        if refused is not None:
            return refused
        f = self.files.get(f"{repo}/{request.match_info['path']}")
        if f is None:
            return self._missing(repo)
        location = f"http://127.0.0.1:{self.cdn_port}/blobs/{f.sha256}?X-Amz-Signature=standin"
        headers = {
            "X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size),
            "ETag": f'"{f.blob_id}"', "Location": location, "Content-Type": "text/plain; charset=utf-8",
        }  # fmt: skip
        return web.Response(status=302, headers=headers, text=f"Found. Redirecting to {location}")

    async def paths_info(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        refused = self._refused(request, repo)
        if refused is not None:
            return refused
        if not any(k.startswith(repo + "/") for k in self.files):
            return self._missing(repo)
        form = await request.post()
        out = []
        for p in form.getall("paths", []):
            f = self.files.get(f"{repo}/{p}")
            if f is not None:
                lfs = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
                out.append({"type": "file", "path": p, "size": f.size, "oid": f.blob_id, "lfs": lfs})
        return web.json_response(out)

    async def blob(self, request: web.Request) -> web.StreamResponse:
        self.cdn_saw_authorization += "Authorization" in request.headers
        f = next((f for f in self.files.values() if f.sha256 == request.match_info["sha"]), None)
        if f is None:
            return web.Response(status=404, text="NoSuchKey")
        rng = request.headers.get("Range", "")
        f.gets.append(rng)
        first = len(f.gets) == 1
        if f.fail_after_cut and not first:
            return web.Response(status=503, text="Service Unavailable")
        start = int(rng[6:].split("-")[0] or 0) if rng.startswith("bytes=") else 0
        body = bytes(b ^ 0xFF for b in f.data) if f.corrupt_once and first else f.data
        part = body[start:]
        headers = {"ETag": f'"cdn-{f.sha256[:16]}"', "Accept-Ranges": "bytes", "Content-Length": str(len(part)),
                   "Content-Type": "application/octet-stream"}  # fmt: skip
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        resp = web.StreamResponse(status=206 if start else 200, headers=headers)
        await resp.prepare(request)
        self.sent += len(part) if f.cut_after is None or not first else f.cut_after
        if f.cut_after is not None and first:
            await resp.write(part[: f.cut_after])
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-file
            return resp
        await resp.write(part)
        await resp.write_eof()
        return resp
