"""FAKE: a local stand-in for the Hugging Face hub (the one boundary these machines cannot reach).

It speaks the parts of the hub's HTTP API that huggingface_hub's downloads use: HEAD/GET
``/{org}/{repo}/resolve/{revision}/{file}`` with ``X-Repo-Commit``, ``X-Linked-Etag`` (the LFS sha256),
``X-Linked-Size``, byte ranges for resumes, and the hub's error codes (``X-Error-Code``) for 401 and 404.
Faults on demand: cut the connection halfway through a file once, or serve corrupted bytes once.
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
    data: bytes
    cut_once: bool = False  # the first GET stops halfway and drops the connection
    corrupt_once: bool = False  # the first full GET serves different bytes
    gets: int = 0

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class HubStandin:
    files: dict[str, HubFile] = field(default_factory=dict)  # "org/repo/file" -> content
    gated: set[str] = field(default_factory=set)  # "org/repo"
    port: int = 0

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_route("*", "/{org}/{repo}/resolve/{rev}/{path:.+}", self.resolve)
            runner = web.AppRunner(app)
            self.loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        key = f"{repo}/{request.match_info['path']}"
        if repo in self.gated:
            return web.Response(status=401, headers={"X-Error-Code": "GatedRepo"}, text="gated")
        f = self.files.get(key)
        if f is None:
            code = "EntryNotFound" if any(k.startswith(repo + "/") for k in self.files) else "RepoNotFound"
            return web.Response(status=404, headers={"X-Error-Code": code}, text="not found")
        headers = {
            "X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{f.sha256}"', "ETag": f'"{f.sha256}"',
            "X-Linked-Size": str(len(f.data)), "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
        }  # fmt: skip
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(len(f.data))})
        f.gets += 1
        start = 0
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0] or 0)
        body = f.data
        if f.corrupt_once and f.gets == 1:
            body = bytes(b ^ 0xFF for b in body)
        part = body[start:]
        status = 206 if start else 200
        resp = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(len(part))})
        if start:
            resp.headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        await resp.prepare(request)
        if f.cut_once and f.gets == 1:
            await resp.write(part[: len(part) // 2])
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-file
            return resp
        await resp.write(part)
        await resp.write_eof()
        return resp
