"""Fetching a model file from the members that serve it: the whole file (``fetch_from_peers``), or a
worker's partial copy that holds only the layers the plan gives it (``PartialCopy``). ``proto/fetch.py`` decides what
to ask whom and what to believe; this moves the bytes.

On disk: a fetch writes ``.partial/<fingerprint>.part`` under the models dir (sparse: the size of the model, holes
where nothing was fetched) and records the chunks it has checked in ``.partial/<fingerprint>.have``; a restart
checks those again and asks only for the rest. A whole file's SHA-256 and model fingerprint are checked before it
takes its name. A partial copy stays ``.part``: its header, the bytes the model fingerprint samples (so its
fingerprint is the model's: the patched rpc-server loads from it) and its layers' chunks, each checked; the
rpc-server fails a load that meets a hole (patch 0009) and the host pushes that tensor the stock way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from meshllm.errors import UserError
from meshllm.llama.gguf import GGUFHeader, held_with_layer, model_fingerprint, read_header, sampled
from meshllm.net.conn import STREAM_FETCH
from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto
from meshllm.proto import fetch as core
from meshllm.proto.crypto import NodeId
from meshllm.proto.record import is_fingerprint
from meshllm.proto.serving import as_ranges
from meshllm.serve.fetch.direct import DirectLink
from meshllm.serve.fetch.modelfiles import model_shape
from meshllm.serve.fetch.sharing import MANIFEST_TIMEOUT_S, WINDOWS_MAX, Progress, Sharing, read_all

log = logging.getLogger("meshllm.fetch")
CHUNK_TIMEOUT_S = 120.0


async def ask(net: MeshNet, node: NodeId, op: str, fp: str, index: object, most: int, timeout: float
              ) -> bytes | None:  # fmt: skip
    """One request to ``node``; its whole answer, or None (refused, gone, too long, too slow)."""
    conn = net.peers.get(node)
    if conn is None or conn.closed.is_set():
        return None
    try:
        st = conn.open_stream(STREAM_FETCH)
        st.write(msgpack.packb([op, fp, index]), end=True)
        async with asyncio.timeout(timeout):
            return await read_all(st, most)
    except (ConnectionError, TimeoutError):
        return None


def sources_of(net: MeshNet, fp: str, connected: bool = True) -> list[NodeId]:
    """The members whose record says they serve the model with fingerprint ``fp`` (those we are connected to)."""
    core_ = net.core
    if core_ is None:
        return []
    return core.sources(core_.alive(net.now), net.me, fp, set(net.peers) if connected else None)


async def fetch_from_peers(net: MeshNet, fp: str, dest: Path, say: Callable[[str], None] | None = None,
                           track: Sharing | None = None) -> Path:  # fmt: skip
    """The model with fingerprint ``fp`` from the members that have it, into ``dest`` (checked whole before it
    takes that name); ``say``: lines for the user (resuming, progress every 2 s, the end). UserError when no member
    has it, none answers, or the sources that are left all lied. ``track``: where status and /metrics see it."""
    say = say or (lambda line: None)
    asked = time.monotonic()  # the manifests first: a source that has not yet hashed its file does so now
    m, trusted = await believed_manifest(net, fp)
    part, have_file, have = await _prepare(dest.parent, m, m.size)
    plan = core.Fetch(m, have)
    prog = Progress(dest.name, m.size, plan.fetched_bytes(), len(trusted))
    if have:
        say(f"resuming the fetch of {dest.name}: {len(have)} of {len(m.chunks)} chunks kept (checked again)")
    fd = os.open(part, os.O_RDWR)
    written = set(have)  # on disk (``plan.have`` has them once checked, a moment before they are written)
    whole = _WholeHash(m, fd)
    try:
        await _run(net, trusted, plan, fd, prog, have_file, written, say, track, whole)
        if plan.done():
            await whole.advance(written)
    finally:
        os.close(fd)
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
    say(f"fetched {dest.name} from the mesh in {secs:.1f} s ({time.monotonic() - asked:.1f} s with the manifests; "
        f"{each}), checked whole (SHA-256 and fingerprint)")
    return dest


async def believed_manifest(net: MeshNet, fp: str) -> tuple[core.Manifest, list[NodeId]]:
    """The manifest of ``fp`` that the mesh's host-scoped holders vouch for (``proto/fetch.believe``), and the
    members, of any scope, that carry those bytes (UserError: none has it, none answers, or they disagree)."""
    core_ = net.core
    sources = sources_of(net, fp)
    if core_ is None or not sources:
        raise UserError(f"no member of the mesh serves the model {fp[:12]}")
    answers = await asyncio.gather(*(ask(net, s, "manifest", fp, 0, 64 << 20, MANIFEST_TIMEOUT_S) for s in sources))
    manifests = [m for s, raw in zip(sources, answers, strict=True)
                 if raw is not None and (m := core.decode_manifest(raw, s, fp)) is not None]  # fmt: skip
    vouchers = core.vouchers(core_.alive(net.now), fp) - {net.me}
    picked = core.believe(manifests, vouchers, core_.elected_for(fp, net.now))
    if isinstance(picked, str):
        raise UserError(f"cannot fetch the model {fp[:12]} from the mesh: {picked} ({len(manifests)} of "
                        f"{len(sources)} members that have it sent a manifest)")  # fmt: skip
    return picked


async def _prepare(where: Path, m: core.Manifest, need_most: int) -> tuple[Path, Path, set[int]]:
    """``.partial/<fingerprint>.part`` under ``where``, the size of the file (sparse), with the chunks a cut fetch
    kept (checked again), once the disk has room for ``need_most`` bytes less those kept. The fingerprint names the
    files: 64 hex digits, never a path."""
    if not is_fingerprint(m.fingerprint):
        raise UserError(f"a model fingerprint is 64 hex digits, not {m.fingerprint[:80]!r}")
    part_dir = where / ".partial"
    part_dir.mkdir(parents=True, exist_ok=True)
    part, have_file = part_dir / f"{m.fingerprint}.part", part_dir / f"{m.fingerprint}.have"
    have = await asyncio.to_thread(_resume, part, have_file, m)
    need = need_most - sum(m.lengths[i] for i in have)
    free = shutil.disk_usage(part_dir).free
    if need > free:
        raise UserError(f"fetching {m.fingerprint[:12]} from the mesh needs {need / 1e9:.1f} GB more on {part_dir}; "
                        f"{free / 1e9:.1f} GB free")  # fmt: skip
    with part.open("ab"):
        pass
    if part.stat().st_size != m.size:
        os.truncate(part, m.size)
    return part, have_file, have


async def _run(net: MeshNet, trusted: list[NodeId], plan: core.Fetch, fd: int, prog: Progress, have_file: Path,
               written: set[int], say: Callable[[str], None], track: Sharing | None,
               whole: _WholeHash | None = None) -> None:  # fmt: skip
    """Every trusted source pulls its share of ``plan`` into ``fd``; progress every 2 s, and where status sees it."""
    shown = [time.monotonic()]

    def on_progress(p: Progress) -> None:
        if time.monotonic() - shown[0] >= 2.0:
            shown[0] = time.monotonic()
            say(p.line())

    if track is not None:
        track.fetching = prog
    try:
        await asyncio.gather(*(_pull(net, s, plan, fd, prog, have_file, written, whole, on_progress)
                               for s in trusted))  # fmt: skip
    finally:
        _save_have(have_file, written, plan.manifest.promise())
        if track is not None:
            track.fetching = None
            for s, n in prog.fetched.items():  # per source, over every fetch of this node
                track.fetched[s] = track.fetched.get(s, 0) + n


@dataclass
class PartialCopy:
    """A worker's copy of the model that holds only some layers: ``.partial/<fingerprint>.part`` with the header and
    the chunks of the layers fetched so far, each checked against the manifest its sources agree on (whose
    fingerprint was checked when it opened). The rpc-server loads from it."""

    net: MeshNet
    manifest: core.Manifest
    trusted: list[NodeId]  # the sources that made the believed promise
    path: Path
    have_file: Path
    header: GGUFHeader
    have: set[int]  # chunks on disk, checked
    name: str  # the model's name, for people
    by_layer: dict[int, set[int]] = field(default_factory=dict)  # each layer's chunks (from the header, once)

    def __post_init__(self) -> None:
        for i in range(model_shape(self.header).n_layer):
            self.by_layer[i] = self.manifest.covering((t.offset, t.nbytes) for t in self.header.tensors
                                                      if held_with_layer(t.name) == i)  # fmt: skip

    def chunks_of(self, layers: set[int]) -> set[int]:
        """The chunks holding the tensors of ``layers``."""
        return set().union(*(self.by_layer.get(i, set()) for i in layers))

    def held(self) -> tuple[tuple[int, int], ...]:
        """The layers whose every chunk is here, as (first, count) ranges (what our record says; asked at every
        change of the mesh)."""
        return as_ranges(i for i, chunks in self.by_layer.items() if chunks <= self.have)

    def give_back(self, layers: set[int]) -> int:
        """Free the disk of the chunks of every layer but ``layers`` (the header stays, and any chunk a kept layer
        shares): holes punched in the sparse file, the chunks forgotten; the bytes given back."""
        keep = {0} | self.chunks_of(layers)
        drop = (set().union(*self.by_layer.values()) & self.have) - keep
        if not drop:
            return 0
        fd = os.open(self.path, os.O_RDWR)
        try:
            for i in sorted(drop):
                punch_hole(fd, *self.manifest.span(i))
        finally:
            os.close(fd)
        self.have -= drop
        _save_have(self.have_file, self.have, self.manifest.promise())
        return sum(self.manifest.lengths[i] for i in drop)

    async def fetch_layers(self, layers: set[int], say: Callable[[str], None], track: Sharing | None) -> None:
        """The chunks of ``layers`` this copy lacks, from the trusted sources (UserError: they all failed)."""
        want = self.chunks_of(layers) - self.have
        if not want:
            return
        m = self.manifest
        need = sum(m.lengths[i] for i in want)
        free = shutil.disk_usage(self.path.parent).free
        if need > free:
            raise UserError(f"fetching layers of {self.name} needs {need / 1e9:.1f} GB more on {self.path.parent}; "
                            f"{free / 1e9:.1f} GB free")  # fmt: skip
        plan = core.Fetch(m, set(self.have), want=want)
        r = as_ranges(layers)
        what = ", ".join(f"{f}–{f + c - 1}" if c > 1 else str(f) for f, c in r)
        what += " (with the token embedding)" if 0 in layers else ""
        prog = Progress(f"layers {what} of {self.name}", need, 0, len(self.trusted))
        fd = os.open(self.path, os.O_RDWR)
        written = set(self.have)
        try:
            await _run(self.net, self.trusted, plan, fd, prog, self.have_file, written, say, track)
        finally:
            os.close(fd)
            self.have = written
        if not plan.done():
            why = "; ".join(f"{crypto.short(s)}: {w}" for s, w in plan.dropped.items()) or "no source left"
            raise UserError(f"could not fetch layers {what} of {self.name} ({why})")
        secs = time.monotonic() - prog.started
        say(f"fetched layers {what} of {self.name} from the mesh: {need / 1e6:.0f} MB in {secs:.1f} s, each chunk "
            "checked")  # fmt: skip


async def open_partial(net: MeshNet, fp: str, where: Path, name: str, say: Callable[[str], None],
                       track: Sharing | None = None) -> PartialCopy:  # fmt: skip
    """A partial copy of the model ``fp`` under ``where``, resumed where one is: its header chunk and the bytes the
    fingerprint samples of each tensor, fetched and checked (the fingerprint too, at the end). No layer yet."""
    m, trusted = await believed_manifest(net, fp)
    if not m.windows:
        raise UserError(f"the members serving {name} sent no tensor samples (an older mesh-llm): fetch it whole")
    part, have_file, have = await _prepare(where, m, m.lengths[0])
    if 0 not in have:  # the header: metadata and the tensor table
        plan = core.Fetch(m, set(have), want={0})
        fd = os.open(part, os.O_RDWR)
        written = set(have)
        try:
            await _run(net, trusted, plan, fd, Progress(f"the header of {name}", m.lengths[0]), have_file, written,
                       say, track)  # fmt: skip
        finally:
            os.close(fd)
        if not plan.done():
            raise UserError(f"could not fetch the header of {name} from the mesh")
        have = written
    header = await asyncio.to_thread(read_header, part)
    if len(header.tensors) != len(m.windows):
        raise UserError(f"the manifest of {name} names {len(m.windows)} tensors, its header {len(header.tensors)}")
    copy = PartialCopy(net, m, trusted, part, have_file, header, have, name)
    samples = await _fetch_samples(copy)  # in memory: on disk they would cost a worker ~64 KiB a tensor
    if await asyncio.to_thread(model_fingerprint, part, samples.__getitem__) != fp:
        raise UserError(f"the partial copy of {name} fetched from the mesh does not have the model's fingerprint")
    return copy


async def _fetch_samples(copy: PartialCopy) -> dict[int, bytes]:
    """Each tensor's bytes that the model fingerprint samples: read from the chunks we hold, fetched for the others,
    checked one tensor at a time against the manifest; a source that sends one bad tensor's bytes is asked nothing
    more. They prove the header and the manifest are the model's (its fingerprint); none is written to disk."""
    m, tensors = copy.manifest, copy.header.tensors
    out: dict[int, bytes] = {}
    with copy.path.open("rb") as f:
        for i, t in enumerate(tensors):
            if m.covering([(t.offset, t.nbytes)]) <= copy.have:
                out[i] = b"".join(os.pread(f.fileno(), n, off) for off, n in sampled(t))
    missing = [i for i in range(len(tensors)) if i not in out]
    sources = list(copy.trusted)
    while missing:
        if not sources:
            raise UserError(f"no member sent the tensor samples of {copy.name} as promised")
        batch, src = missing[:WINDOWS_MAX], sources[0]
        most = sum(n for i in batch for _, n in sampled(tensors[i]))
        raw = await ask(copy.net, src, "windows", m.fingerprint, batch, most, CHUNK_TIMEOUT_S) or b""
        at, good = 0, len(raw) == most
        for i in batch if good else []:
            n = sum(k for _, k in sampled(tensors[i]))
            piece, at = raw[at : at + n], at + n
            if not m.check_window(i, piece):
                good = False
                break
            out[i] = piece
            missing.remove(i)
        if not good:
            log.warning("%s sent tensor samples that are not the ones promised (or none)", crypto.short(src))
            sources.pop(0)
    return out


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
                written: set[int], whole: _WholeHash | None, on_progress: Callable[[Progress], None] | None
                ) -> None:  # fmt: skip
    """One source's share: up to IN_FLIGHT chunks asked of it at a time, until nothing is left for it; over the
    direct path (a TLS connection per chunk in flight) where it works, else QUIC streams."""
    m = plan.manifest
    links = await _Links.of(net, source, m.fingerprint)

    async def one(i: int) -> None:
        data = None
        link = await links.take() if links else None
        if link is not None and links is not None:
            data = await link.get(m.fingerprint, i, m.most, CHUNK_TIMEOUT_S)
            links.give(link, data is not None)
        if data is None:  # no direct path, or it failed: this chunk (and the rest) on the QUIC stream
            data = await ask(net, source, "chunk", m.fingerprint, i, m.most, CHUNK_TIMEOUT_S)
        if data is None:
            plan.drop(source, "stopped answering")
            return
        dropped = source in plan.dropped
        if not plan.arrived(source, i, data):
            if not dropped:  # its other chunks in flight may be bad too: said once
                log.warning("%s sent a chunk that is not the one promised: dropped as a source", crypto.short(source))
            return
        await asyncio.to_thread(os.pwrite, fd, data, m.span(i)[0])
        written.add(i)  # only now may the record of what a restart keeps name it
        if whole is not None:
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
        return cls(conn.addr[0], raw) if raw else None

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


_FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


@functools.cache
def _fallocate() -> Any:
    """libc's fallocate (None where there is none), looked up once."""
    import ctypes
    import ctypes.util

    f = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), "fallocate", None)
    if f is not None:
        f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return f


def punch_hole(fd: int, off: int, n: int) -> None:
    """Free ``n`` bytes at ``off`` of a file's disk, keeping its size (reads give zeros); where the system cannot
    (not Linux, a file system without holes), the bytes are overwritten with zeros, which frees nothing."""
    import ctypes

    fallocate = _fallocate()
    if fallocate is not None and fallocate(fd, _FALLOC_PUNCH, off, n) == 0:
        return
    log.info("cannot punch a hole here (%s): zeroed instead", os.strerror(ctypes.get_errno()))
    os.pwrite(fd, bytes(n), off)


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



