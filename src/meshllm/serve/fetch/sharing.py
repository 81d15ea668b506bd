"""Model files through the mesh, the source's side: a member serves the model files it has to members that
fetch them (``serve/fetch/pull.py``), named by their fingerprint.

On the wire: a QUIC stream of kind STREAM_FETCH per request, opened only on an authenticated member's connection
(or a TLS connection of the direct path, ``fetch_direct.py``). The request is msgpack ``[op, fingerprint, arg]``:
op "manifest" answers the source's signed manifest for the model with that fingerprint; "chunk" chunk ``arg`` of
it; "windows" the bytes the model fingerprint samples of the tensors numbered in ``arg`` (a list, at most
WINDOWS_MAX), one after another; "ticket" a ticket for the direct path. A member serves only the model files it
serves itself whole (no path of the asker's choosing), at most ``UPLOADS`` requests at a time, and nothing with
``--share off``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.llama.gguf import TensorInfo, layer_of, read_header, sampled
from meshllm.net.conn import Conn, Stream
from meshllm.proto import crypto
from meshllm.proto import fetch as core
from meshllm.proto.crypto import NodeId
from meshllm.serve.fetch.direct import DirectSource

log = logging.getLogger("meshllm.fetch")
UPLOADS = 4  # requests this node answers at once, to everyone together
MAX_REQUEST = 1024
WINDOWS_MAX = 64  # tensors one "windows" request may name (at most 64 KiB each)
MANIFEST_TIMEOUT_S = 600.0  # a source hashes a file it never hashed before (a 40 GB model: minutes)


# ------------------------------------------------------------------------------------------------ serving


@dataclass
class Sharing:
    """This node's side as a source."""

    key: Ed25519PrivateKey
    state_dir: Path
    files: Callable[[], dict[str, Path]]  # fingerprint -> the model file this node serves
    share: bool = True  # --share off: serve nothing
    bind_host: str = "0.0.0.0"  # where the direct path's TLS listener listens (opened at the first ticket)
    sent: dict[NodeId, int] = field(default_factory=dict)  # bytes sent per peer
    fetched: dict[NodeId, int] = field(default_factory=dict)  # bytes this node fetched from each source
    fetching: Progress | None = None  # the fetch under way (status, the console)
    direct: DirectSource | None = None
    _direct_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _uploads: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(UPLOADS))
    _manifests: dict[str, core.Manifest] = field(default_factory=dict)
    _hashing: dict[str, asyncio.Lock] = field(default_factory=dict)
    _tensors: dict[str, list[TensorInfo]] = field(default_factory=dict)

    async def on_stream(self, conn: Conn, st: Stream) -> None:
        peer = conn.peer
        req = await read_all(st, MAX_REQUEST)
        try:
            op, fp, index = msgpack.unpackb(req) if req is not None else (None, None, None)
        except (ValueError, TypeError, msgpack.UnpackException):
            op = fp = index = None
        path = self.files().get(fp) if isinstance(fp, str) else None
        if peer is None or not self.share or path is None or op not in ("manifest", "chunk", "windows", "ticket"):
            st.reset()
            return
        assert isinstance(fp, str)
        try:
            if op == "manifest":
                st.write((await self.manifest(fp, path)).encode(), end=True)
            elif op == "ticket":  # the direct path (TCP + TLS), opened at the first ask
                async with self._direct_lock:
                    if self.direct is None:
                        d = DirectSource(self.state_dir, self.bind_host, self.chunk)
                        await d.start()
                        self.direct = d
                st.write(self.direct.ticket(peer, time.monotonic()), end=True)
            else:
                data = await (self.windows(peer, fp, path, index) if op == "windows" else self.chunk(peer, fp, index))
                if data is not None:
                    st.write(data, end=True)
                else:
                    st.reset()
        except (ConnectionError, OSError) as e:
            log.info("fetch by %s ended: %s", crypto.short(peer), e)
            st.reset()

    async def chunk(self, peer: NodeId, fp: str, index: object) -> bytes | None:
        """Chunk ``index`` of our model with fingerprint ``fp`` for ``peer`` (a member), by either path; None
        for anything we do not serve."""
        path = self.files().get(fp)
        if not self.share or path is None or not isinstance(index, int) or isinstance(index, bool):
            return None
        m = await self.manifest(fp, path)
        if not 0 <= index < len(m.chunks):
            return None
        off, n = m.span(index)
        async with self._uploads:
            data = await asyncio.to_thread(_read_at, path, off, n)
        self.sent[peer] = self.sent.get(peer, 0) + n
        return data

    async def windows(self, peer: NodeId, fp: str, path: Path, which: object) -> bytes | None:
        """The bytes the model fingerprint samples of the tensors numbered in ``which`` (a partial copy fetches those
        of the tensors it does not hold), one tensor after another; None for a request out of bounds."""
        m = await self.manifest(fp, path)
        if not (isinstance(which, list) and 0 < len(which) <= WINDOWS_MAX
                and all(type(t) is int and 0 <= t < len(m.windows) for t in which)):  # fmt: skip
            return None
        tensors = self._tensors.get(fp)
        if tensors is None:
            tensors = self._tensors[fp] = (await asyncio.to_thread(read_header, path)).tensors

        def read() -> bytes:
            with path.open("rb") as f:
                return b"".join(_sampled_bytes(f.fileno(), tensors[t]) for t in which)

        async with self._uploads:
            data = await asyncio.to_thread(read)
        self.sent[peer] = self.sent.get(peer, 0) + len(data)
        return data

    def fetched_now(self) -> dict[NodeId, int]:
        """Bytes fetched from each source, the fetch under way included."""
        out = dict(self.fetched)
        for s, n in self.fetching.fetched.items() if self.fetching else []:
            out[s] = out.get(s, 0) + n
        return out

    async def manifest(self, fp: str, path: Path) -> core.Manifest:
        """Our signed manifest of ``path`` (hashed once; kept in the state dir while the file is unchanged)."""
        got = self._manifests.get(fp)
        if got is not None:
            return got
        async with self._hashing.setdefault(fp, asyncio.Lock()):
            got = self._manifests.get(fp)
            if got is None:
                got = await asyncio.to_thread(_manifest_of, path, fp, self.key, self.state_dir)
                self._manifests[fp] = got
            return got


def _read_at(path: Path, off: int, n: int) -> bytes:
    with path.open("rb") as f:
        return os.pread(f.fileno(), n, off)


MANIFEST_CACHE = 2  # the cache's layout version: another one is hashed again


def _manifest_of(path: Path, fp: str, key: Ed25519PrivateKey, state_dir: Path) -> core.Manifest:
    st = path.stat()
    cache = state_dir / "manifests" / f"{fp}.json"
    stamp = [st.st_size, st.st_mtime_ns]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        d = json.loads(cache.read_text())
        if d["stamp"] == stamp and d["v"] == MANIFEST_CACHE and d["most"] == core.CHUNK:
            return core.make_manifest(fp, st.st_size, bytes.fromhex(d["sha256"]), d["lengths"],
                                      [bytes.fromhex(c) for c in d["chunks"]], key,
                                      [bytes.fromhex(w) for w in d["windows"]])  # fmt: skip
    hdr = read_header(path)
    lengths = core.tile(st.st_size, core.layout_cuts(hdr.data_offset, ((t.offset, t.nbytes, layer_of(t.name))
                                                                       for t in hdr.tensors)))  # fmt: skip
    whole = hashlib.sha256()
    chunks = []
    with path.open("rb") as f:
        for n in lengths:
            block = f.read(n)
            whole.update(block)
            chunks.append(hashlib.sha256(block).digest())
        windows = [hashlib.sha256(_sampled_bytes(f.fileno(), t)).digest() for t in hdr.tensors]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"stamp": stamp, "v": MANIFEST_CACHE, "most": core.CHUNK, "sha256": whole.hexdigest(),
                                 "lengths": list(lengths), "chunks": [c.hex() for c in chunks],
                                 "windows": [w.hex() for w in windows]}))  # fmt: skip
    return core.make_manifest(fp, st.st_size, whole.digest(), lengths, chunks, key, windows)


def _sampled_bytes(fd: int, t: TensorInfo) -> bytes:
    """The bytes of tensor ``t`` that the model fingerprint hashes."""
    return b"".join(os.pread(fd, n, off) for off, n in sampled(t))


@dataclass
class Progress:
    """What a fetch has done, for the terminal, ``status`` and the console."""

    name: str
    size: int
    done: int = 0
    sources: int = 0
    started: float = field(default_factory=time.monotonic)
    fetched: dict[NodeId, int] = field(default_factory=dict)  # bytes per source

    def line(self) -> str:
        d = self.as_dict()
        return (f"fetching {self.name} from {self.sources} peer{'s' if self.sources != 1 else ''}: {d['percent']}%, "
                f"{d['mb_per_s']} MB/s")  # fmt: skip

    def as_dict(self) -> dict[str, object]:
        secs = max(time.monotonic() - self.started, 1e-3)
        return {"name": self.name, "size": self.size, "done": self.done, "sources": self.sources,
                "percent": int(100 * self.done / self.size) if self.size else 100,
                "mb_per_s": round(sum(self.fetched.values()) / secs / 1e6)}  # fmt: skip


async def read_all(st: Stream, most: int) -> bytes | None:
    """Everything the stream carries, or None past ``most`` bytes."""
    out = bytearray()  # (bytes += a datagram's worth at a time copied the whole chunk each time: 5 MB/s)
    while chunk := await st.read():
        out += chunk
        if len(out) > most:
            return None
    return bytes(out)


