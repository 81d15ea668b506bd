"""Model files through the mesh ([fetch]): a member serves the model files it has to members that fetch them, and a
node that lacks its model fetches it from every member that has it at once, in chunks, checked as they arrive
(``proto/fetch.py`` decides what to ask whom and what to believe), resumable across restarts.

On the wire: a QUIC stream of kind STREAM_FETCH per request, opened only on an authenticated member's connection.
The request is msgpack ``[op, fingerprint, index]``: op "manifest" answers the source's signed manifest for the
model with that fingerprint; op "chunk" answers chunk ``index`` of it. A member serves only the model files it
serves itself (named by their fingerprint: no path of the asker's choosing), at most ``UPLOADS`` at a time, and
nothing with ``--share off``.

On disk: the fetch writes ``.partial/<fingerprint>.part`` under the models dir and records the chunks it has checked
in ``.partial/<fingerprint>.have``; a restart checks those again and asks only for the rest. The whole file's
SHA-256 and its model fingerprint are checked before it takes its name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from meshllm.errors import UserError
from meshllm.llama.gguf import model_fingerprint
from meshllm.net.endpoint import STREAM_FETCH, Conn, Stream
from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto
from meshllm.proto import fetch as core
from meshllm.proto.crypto import NodeId
from meshllm.proto.planner import ModelShape
from meshllm.serve.fetch_direct import DirectLink, DirectSource
from meshllm.serve.modelfiles import ModelFiles
from meshllm.serve.options import NodeOptions

log = logging.getLogger("meshllm.fetch")
UPLOADS = 4  # chunks this node sends at once, to everyone together
MAX_REQUEST = 256
MANIFEST_TIMEOUT_S = 600.0  # a source hashes a file it never hashed before (a 40 GB model: minutes)
CHUNK_TIMEOUT_S = 120.0


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

    async def on_stream(self, conn: Conn, st: Stream) -> None:
        peer = conn.peer
        req = await _read_all(st, MAX_REQUEST)
        try:
            op, fp, index = msgpack.unpackb(req) if req is not None else (None, None, None)
        except (ValueError, TypeError, msgpack.UnpackException):
            op = fp = index = None
        path = self.files().get(fp) if isinstance(fp, str) else None
        if peer is None or not self.share or path is None or op not in ("manifest", "chunk", "ticket"):
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
            elif (data := await self.chunk(peer, fp, index)) is not None:
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


def _manifest_of(path: Path, fp: str, key: Ed25519PrivateKey, state_dir: Path) -> core.Manifest:
    st = path.stat()
    cache = state_dir / "manifests" / f"{fp}.json"
    stamp = [st.st_size, st.st_mtime_ns]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        d = json.loads(cache.read_text())
        if d["stamp"] == stamp and d["chunk_size"] == core.CHUNK:
            return core.make_manifest(fp, st.st_size, bytes.fromhex(d["sha256"]),
                                      [bytes.fromhex(c) for c in d["chunks"]], key)  # fmt: skip
    whole = hashlib.sha256()
    chunks = []
    with path.open("rb") as f:
        while block := f.read(core.CHUNK):
            whole.update(block)
            chunks.append(hashlib.sha256(block).digest())
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"stamp": stamp, "chunk_size": core.CHUNK, "sha256": whole.hexdigest(),
                                 "chunks": [c.hex() for c in chunks]}))  # fmt: skip
    return core.make_manifest(fp, st.st_size, whole.digest(), chunks, key)


async def _read_all(st: Stream, most: int) -> bytes | None:
    """Everything the stream carries, or None past ``most`` bytes."""
    out = bytearray()  # (bytes += a datagram's worth at a time copied the whole chunk each time: 5 MB/s)
    while chunk := await st.read():
        out += chunk
        if len(out) > most:
            return None
    return bytes(out)


# ------------------------------------------------------------------------------------------------ fetching


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


async def ask(net: MeshNet, node: NodeId, op: str, fp: str, index: int, most: int, timeout: float) -> bytes | None:
    """One request to ``node``; its whole answer, or None (refused, gone, too long, too slow)."""
    conn = net.peers.get(node)
    if conn is None or conn.closed.is_set():
        return None
    try:
        st = conn.open_stream(STREAM_FETCH)
        st.write(msgpack.packb([op, fp, index]), end=True)
        async with asyncio.timeout(timeout):
            return await _read_all(st, most)
    except (ConnectionError, TimeoutError):
        return None


def sources_of(net: MeshNet, fp: str, connected: bool = True) -> list[NodeId]:
    """The members whose record says they serve the model with fingerprint ``fp`` (those we are connected to)."""
    core_ = net.core
    if core_ is None:
        return []
    return [r.node for r in core_.alive(net.now) if r.node != net.me and r.model is not None
            and r.model.fingerprint == fp and (r.node in net.peers or not connected)]  # fmt: skip


async def fetch_from_peers(net: MeshNet, fp: str, dest: Path, say: Callable[[str], None] | None = None,
                           track: Sharing | None = None) -> Path:  # fmt: skip
    """The model with fingerprint ``fp`` from the members that have it, into ``dest`` (checked whole before it
    takes that name); ``say``: lines for the user (resuming, progress every 2 s, the end). UserError when no member
    has it, none answers, or the sources that are left all lied. ``track``: where status and /metrics see it."""
    say = say or (lambda line: None)
    sources = sources_of(net, fp)
    if not sources:
        raise UserError(f"no member of the mesh serves the model {fp[:12]}")
    answers = await asyncio.gather(*(ask(net, s, "manifest", fp, 0, 64 << 20, MANIFEST_TIMEOUT_S) for s in sources))
    manifests = [m for s, raw in zip(sources, answers, strict=True)
                 if raw is not None and (m := core.decode_manifest(raw, s, fp)) is not None]  # fmt: skip
    picked = core.believe(manifests)
    if picked is None:
        raise UserError(f"none of the {len(sources)} members with the model {fp[:12]} sent a manifest")
    m, trusted = picked
    part_dir = dest.parent / ".partial"
    part_dir.mkdir(parents=True, exist_ok=True)
    part, have_file = part_dir / f"{fp}.part", part_dir / f"{fp}.have"
    have = await asyncio.to_thread(_resume, part, have_file, m)
    need = m.size - sum(m.span(i)[1] for i in have)
    free = shutil.disk_usage(part_dir).free
    if need > free:
        raise UserError(f"fetching {dest.name} needs {need / 1e9:.1f} GB more on {part_dir}; {free / 1e9:.1f} GB free")
    with part.open("ab"):
        pass
    os.truncate(part, m.size)
    plan = core.Fetch(m, have)
    prog = Progress(dest.name, m.size, plan.fetched_bytes(), len(trusted))
    if have:
        say(f"resuming the fetch of {dest.name}: {len(have)} of {len(m.chunks)} chunks kept (checked again)")
    shown = [time.monotonic()]

    def on_progress(p: Progress) -> None:
        if time.monotonic() - shown[0] >= 2.0:
            shown[0] = time.monotonic()
            say(p.line())

    if track is not None:
        track.fetching = prog
    fd = os.open(part, os.O_RDWR)
    written = set(have)  # on disk (``plan.have`` has them once checked, a moment before they are written)
    whole = _WholeHash(m, fd)
    try:
        await asyncio.gather(*(_pull(net, s, plan, fd, prog, have_file, written, whole, on_progress)
                               for s in trusted))  # fmt: skip
        if plan.done():
            await whole.advance(written)
    finally:
        os.close(fd)
        _save_have(have_file, written, m.promise())
        if track is not None:
            track.fetching = None
            for s, n in prog.fetched.items():  # per source, over every fetch of this node
                track.fetched[s] = track.fetched.get(s, 0) + n
    if not plan.done():
        why = "; ".join(f"{crypto.short(s)}: {w}" for s, w in plan.dropped.items()) or "no source left"
        raise UserError(f"could not fetch {dest.name} from the mesh ({why}); "
                        f"{len(plan.have)} of {len(m.chunks)} chunks kept for the next try")  # fmt: skip
    if whole.digest() != m.sha256 or await asyncio.to_thread(model_fingerprint, part) != fp:
        part.unlink()
        have_file.unlink(missing_ok=True)
        raise UserError(f"the file fetched for {dest.name} is not the model its sources promised: deleted")
    part.replace(dest)
    have_file.unlink(missing_ok=True)
    secs = time.monotonic() - prog.started
    each = ", ".join(f"{crypto.short(s)} {n / 1e6:.0f} MB" for s, n in sorted(prog.fetched.items()))
    say(f"fetched {dest.name} from the mesh in {secs:.1f} s ({each}), checked whole (SHA-256 and fingerprint)")
    return dest


class _WholeHash:
    """The whole file's SHA-256, advanced over the chunks on disk in file order while the rest are on the way (the
    fetch no longer reads the whole file again at its end: a 1 Gbit/s link sat idle meanwhile)."""

    def __init__(self, m: core.Manifest, fd: int) -> None:
        self.m, self.fd = m, fd
        self.h = hashlib.sha256()
        self.next = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def _step(self, i: int) -> None:
        off, n = self.m.span(i)
        self.h.update(os.pread(self.fd, n, off))

    async def advance(self, written: set[int]) -> None:
        async with self._lock:
            while self.next in written:
                await asyncio.to_thread(self._step, self.next)
                self.next += 1

    def kick(self, written: set[int]) -> None:
        """Advance in the background (the chunk's connection asks for its next chunk meanwhile)."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.advance(written))

    def digest(self) -> bytes | None:
        """None until every chunk went in."""
        return self.h.digest() if self.next == len(self.m.chunks) else None


async def _pull(net: MeshNet, source: NodeId, plan: core.Fetch, fd: int, prog: Progress, have_file: Path,
                written: set[int], whole: _WholeHash, on_progress: Callable[[Progress], None] | None
                ) -> None:  # fmt: skip
    """One source's share: up to IN_FLIGHT chunks asked of it at a time, until nothing is left for it; over the
    direct path (a TLS connection per chunk in flight) where it works, else QUIC streams."""
    m = plan.manifest
    links = await _Links.of(net, source, m.fingerprint)

    async def one(i: int) -> None:
        data = None
        link = await links.take() if links else None
        if link is not None and links is not None:
            data = await link.get(m.fingerprint, i, m.chunk_size, CHUNK_TIMEOUT_S)
            links.give(link, data is not None)
        if data is None:  # no direct path, or it failed: this chunk (and the rest) on the QUIC stream
            data = await ask(net, source, "chunk", m.fingerprint, i, m.chunk_size, CHUNK_TIMEOUT_S)
        if data is None:
            plan.drop(source, "stopped answering")
            return
        if not plan.arrived(source, i, data):
            log.warning("%s sent a chunk that is not the one promised: dropped as a source", crypto.short(source))
            return
        await asyncio.to_thread(os.pwrite, fd, data, m.span(i)[0])
        written.add(i)  # only now may the record of what a restart keeps name it
        whole.kick(written)
        prog.done += len(data)
        prog.fetched[source] = prog.fetched.get(source, 0) + len(data)
        if len(written) % 4 == 0:
            _save_have(have_file, written, m.promise())
        if on_progress is not None:
            on_progress(prog)

    running: set[asyncio.Task[None]] = set()
    while True:
        while (i := plan.next_for(source)) is not None:
            running.add(asyncio.ensure_future(one(i)))
        if not running:
            # nothing for us now: done, dropped, or the others hold what is left (they may yet give it back)
            if plan.done() or source in plan.dropped or not plan.asked:
                return
            await asyncio.sleep(0.05)
            continue
        _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    if links:
        links.close()


class _Links:
    """The direct path's connections to one source: up to IN_FLIGHT, opened as needed with one ticket; none any
    more once one failed (the QUIC stream serves then)."""

    def __init__(self, ip: str, ticket: bytes) -> None:
        self.ip, self.ticket = ip, ticket
        self.idle: list[DirectLink] = []
        self.opened = 0
        self.broken = False

    @classmethod
    async def of(cls, net: MeshNet, source: NodeId, fp: str) -> _Links | None:
        conn = net.peers.get(source)
        if conn is None or conn.relay is not None:  # through a relay: a TCP port of that member is out of reach
            return None
        raw = await ask(net, source, "ticket", fp, 0, 4096, 10.0)
        return cls(conn.addr[0].removeprefix("::ffff:"), raw) if raw else None

    def __bool__(self) -> bool:
        return not self.broken

    async def take(self) -> DirectLink | None:
        if self.broken:
            return None
        if self.idle:
            return self.idle.pop()
        if self.opened >= core.IN_FLIGHT:
            return None
        self.opened += 1
        link = await DirectLink.open(self.ip, self.ticket)
        if link is None:
            self.broken = True
            log.info("no direct fetch path to %s: QUIC streams", self.ip)
        return link

    def give(self, link: DirectLink, ok: bool) -> None:
        if ok:
            self.idle.append(link)
        else:
            self.broken = True

    def close(self) -> None:
        for link in self.idle:
            link.close()


def _resume(part: Path, have_file: Path, m: core.Manifest) -> set[int]:
    """The chunks a cut fetch kept, checked again (an entry without its bytes, or with other bytes, is dropped)."""
    try:
        listed = set(json.loads(have_file.read_text()).get(m.promise().hex(), []))
    except (OSError, ValueError, AttributeError):
        return set()
    if not part.exists() or part.stat().st_size != m.size:
        return set()
    good = set()
    with part.open("rb") as f:
        for i in sorted(x for x in listed if isinstance(x, int) and 0 <= x < len(m.chunks)):
            off, n = m.span(i)
            if m.check(i, os.pread(f.fileno(), n, off)):
                good.add(i)
    return good


def _save_have(have_file: Path, have: set[int], promise: bytes) -> None:
    """The chunks checked so far, under the promise they were checked against (another one starts afresh)."""
    with contextlib.suppress(OSError):
        tmp = have_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({promise.hex(): sorted(have)}))
        tmp.replace(have_file)



# ------------------------------------------------------------------------------------------------ a node's model


def is_local(arg: str, where: Path | None) -> bool:
    """Whether ``--model arg`` names a file this machine has (a path, or a name installed in the models dir); an
    explicit path that does not exist is the user's error, said at once."""
    from meshllm.models.download import resolve

    if Path(arg).expanduser().exists():
        return True
    if arg.startswith(("/", "./", "../", "~")):
        raise UserError(f"--model {arg}: no such file")
    try:
        return resolve(arg, where, fetch=False).is_file()
    except UserError:  # not installed, or a name only the mesh knows (its model's name or fingerprint)
        return False


def mesh_file_for(net: MeshNet, name: str) -> tuple[str, str, int] | None:
    """The model a member serves under ``name`` (its name as served, a catalog name or alias of it, or its
    fingerprint's first 12+ hex digits): (fingerprint, the name it is served under, size), or None."""
    from meshllm.models import catalog

    core_ = net.core
    if core_ is None:
        return None
    want = catalog.find(name)
    for r in core_.alive(net.now):
        m = r.model
        if m is None or r.node == net.me:
            continue
        same_entry = want is not None and catalog.find(m.source) is want
        if m.source == name or same_entry or (len(name) >= 12 and m.fingerprint.startswith(name.lower())):
            return m.fingerprint, m.source, m.size
    return None


KNOWN_GRACE_S = 3.0  # once members' models are known, how long a name none of them serves may still turn up


def _mesh_models_known(net: MeshNet) -> bool:
    """Whether we hold a record of another member that serves a model (gossip has brought the mesh's models)."""
    core_ = net.core
    return core_ is not None and any(r.model is not None and r.node != net.me for r in core_.alive(net.now))


def file_name_for(name: str, served_as: str) -> str:
    """The file name a fetched model takes in the models dir: the catalog's, the hub reference's, else the name it
    is served under."""
    from meshllm.models import catalog

    e = catalog.find(name) or catalog.find(served_as)
    if e is not None:
        return e.files[0]
    base = name.rsplit("/", 1)[-1] if name.endswith(".gguf") else served_as.rsplit("/", 1)[-1]
    return base if base.endswith(".gguf") else f"{base}.gguf"


async def obtain_model(net: MeshNet, name: str, where_opt: Path | None, console: Console, wait_s: float = 30.0,
                       track: Sharing | None = None) -> Path:  # fmt: skip
    """``--model name`` that this machine lacks, once in the mesh: from the members that serve it; the hub when
    none does (``resolve`` downloads catalog and hub models)."""
    from meshllm.models.download import inside, resolve
    from meshllm.paths import models_dir

    where = models_dir(where_opt)
    found = None
    deadline = time.monotonic() + wait_s
    while (found := mesh_file_for(net, name)) is None or not sources_of(net, found[0]):
        if time.monotonic() >= deadline:
            break
        if found is None and _mesh_models_known(net):  # the mesh's models are known, and not this one
            deadline = min(deadline, time.monotonic() + KNOWN_GRACE_S)
        await asyncio.sleep(0.25)
    if found is None:
        console.print(f"no member serves {name}: downloading it from the hub")
        return await asyncio.to_thread(resolve, name, where_opt)
    fp, served_as, size = found
    while set(sources_of(net, fp, connected=False)) - set(sources_of(net, fp)) and time.monotonic() < deadline:
        await asyncio.sleep(0.25)  # the members we are still connecting to: every source helps
    dest = inside(where, file_name_for(name, served_as))
    n = len(sources_of(net, fp))
    console.print(f"fetching {served_as} ({size / 1e9:.2f} GB) from {n} member{'s' if n != 1 else ''} of the mesh "
                  f"into {dest}")  # fmt: skip
    return await fetch_from_peers(net, fp, dest, lambda line: console.print(line, markup=False), track)


async def obtain_and_open(net: MeshNet, name: str, o: NodeOptions, console: Console, track: Sharing | None = None
                          ) -> tuple[ModelFiles, ModelShape]:  # fmt: skip
    """``obtain_model``, then the model opened as ``--model name`` would have opened it (served under that name)."""
    from meshllm.serve.modelfiles import open_model

    path = await obtain_model(net, name, o.models_dir, console, track=track)
    try:
        model, shape, _ = await asyncio.to_thread(open_model, Path(name), o.models_dir, o.draft, o.no_draft)
    except UserError:  # a name the models dir does not know it by (a fingerprint): by its file
        model, shape, _ = await asyncio.to_thread(open_model, path, o.models_dir, o.draft, o.no_draft)
    return model, shape
