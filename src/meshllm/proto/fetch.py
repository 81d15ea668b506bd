"""Fetching a model file from the members that have it, pure: what a source promises (a signed manifest
of chunk hashes), which promise to believe when sources disagree, and which chunk to ask which source for next.
The shells (``serve/fetch/sharing.py``, ``serve/fetch/pull.py``) move the bytes and keep the clock; nothing here
does I/O.

A source's manifest names the file (its model fingerprint, size and whole-file SHA-256) and the SHA-256 of every
chunk, signed with the source's node key: a signed lie is evidence against that member. Chunks tile the file and
follow its layout (``cuts``): the header is one chunk, each layer's tensors start a new one, and no chunk is longer
than CHUNK, so a worker that needs only some layers fetches their chunks and nothing else. The manifest also holds
the SHA-256 of each tensor's bytes that the model fingerprint samples (its "windows"): a partial copy fetches those
of the tensors it does not hold, checked one tensor at a time, so its fingerprint is the model's.

Who decides what is true: only host-scoped members that hold the whole file (``vouchers``) — those
the mesh lets run the model for everyone. The fetcher asks every source for its manifest and believes the one the
model's elected host signs; where the host did not answer, the one every voucher that answered signs; members
that vouch for different bytes (and no host among them) stop the fetch with an error. No vote is counted and no
tie is broken by node id: a member below host scope, however many keys it holds, only carries bytes (its manifest
says it has the believed ones) and decides nothing. Each chunk is checked on arrival: a source that sends one bad
chunk is dropped at once (its chunk goes to the others), so a liar costs at most one chunk. A whole file's SHA-256
is checked at the end; nothing unchecked ever takes the model's name.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from functools import cached_property

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.record import PeerRecord, Role, is_fingerprint
from meshllm.proto.token import Scope

D_MANIFEST = b"mesh-llm manifest v2\0"
CHUNK = 8 << 20  # bytes per chunk at most: a 40 GB model is ~5,000 chunks, its manifest ~200 KB
MAX_CHUNKS = 1 << 20  # 8 TiB at the default size: anything larger is not a model we fetch
MAX_TENSORS = 1 << 16
IN_FLIGHT = 4  # chunks asked of one source at a time, once it has sent one good chunk (one until then)


@dataclass(frozen=True)
class Manifest:
    fingerprint: str  # the model fingerprint (llama/gguf.py) the file has
    size: int
    sha256: bytes  # of the whole file
    lengths: tuple[int, ...]  # each chunk's length, in file order: they tile the file
    chunks: tuple[bytes, ...]  # SHA-256 of each chunk, in order
    windows: tuple[bytes, ...] = ()  # SHA-256 of each tensor's sampled bytes, in the header's tensor order
    source: NodeId = b""
    sig: bytes = b""

    def body(self) -> bytes:
        return msgpack.packb([self.fingerprint, self.size, self.sha256, list(self.lengths), list(self.chunks),
                              list(self.windows)])  # fmt: skip

    def signed_by(self, key: Ed25519PrivateKey) -> Manifest:
        return Manifest(self.fingerprint, self.size, self.sha256, self.lengths, self.chunks, self.windows,
                        crypto.node_id(key), crypto.sign(key, D_MANIFEST, self.body()))  # fmt: skip

    @cached_property
    def starts(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return tuple(out)

    def encode(self) -> bytes:
        return msgpack.packb([self.body(), self.source, self.sig])

    def promise(self) -> bytes:
        """What two sources agree on when they agree (their manifests but for the signer)."""
        return hashlib.sha256(self.body()).digest()

    def span(self, i: int) -> tuple[int, int]:
        """Chunk ``i``'s offset and length."""
        return self.starts[i], self.lengths[i]

    def check(self, i: int, data: bytes) -> bool:
        return 0 <= i < len(self.chunks) and len(data) == self.lengths[i] and \
            hashlib.sha256(data).digest() == self.chunks[i]  # fmt: skip

    def check_window(self, t: int, data: bytes) -> bool:
        """Whether ``data`` are tensor ``t``'s sampled bytes as promised."""
        return 0 <= t < len(self.windows) and hashlib.sha256(data).digest() == self.windows[t]

    def covering(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        """The chunks that hold any byte of ``ranges`` (offset, length)."""
        out: set[int] = set()
        for off, n in ranges:
            if n <= 0:
                continue
            first = max(0, bisect.bisect_right(self.starts, off) - 1)
            last = bisect.bisect_right(self.starts, off + n - 1) - 1
            out.update(range(first, last + 1))
        return out

    @property
    def most(self) -> int:
        """The longest chunk."""
        return max(self.lengths, default=0)


def tile(size: int, cuts: Iterable[int], most: int = CHUNK) -> tuple[int, ...]:
    """Chunk lengths that tile ``size`` bytes, starting a chunk at every cut (inside the file) and cutting any
    longer than ``most``."""
    lengths: list[int] = []
    points = sorted({c for c in cuts if 0 < c < size} | {size})
    at = 0
    for p in points:
        while p - at > most:
            lengths.append(most)
            at += most
        lengths.append(p - at)
        at = p
    return tuple(lengths)


def layout_cuts(data_offset: int, tensors: Iterable[tuple[int, int, int | None]]) -> list[int]:
    """Where a GGUF file's chunks start: its data section, and wherever the tensors (offset, length, layer or None),
    taken in file order, pass from one layer (or from the layerless ones) to another."""
    cuts = [data_offset]
    ordered = sorted(tensors, key=lambda t: t[0])
    for (_, _, before), (off, _, layer) in itertools.pairwise(ordered):
        if layer != before:
            cuts.append(off)
    return cuts


def decode_manifest(raw: bytes, source: NodeId, fingerprint: str) -> Manifest | None:
    """A manifest from ``source`` for ``fingerprint``, signed by it and self-consistent; None for anything else."""
    try:
        outer = msgpack.unpackb(raw)
        body, signer, sig = outer
        fp, size, sha, lengths, chunks, windows = msgpack.unpackb(body)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if signer != source or not isinstance(sig, bytes) or not crypto.verify(source, D_MANIFEST, body, sig):
        return None
    if fp != fingerprint or not is_fingerprint(fp) or not isinstance(sha, bytes) or len(sha) != 32:
        return None
    if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        return None
    if not (isinstance(lengths, list) and isinstance(chunks, list) and len(lengths) == len(chunks) <= MAX_CHUNKS):
        return None
    if not all(type(n) is int and 0 < n <= CHUNK for n in lengths) or sum(lengths) != size:
        return None
    if not (isinstance(windows, list) and len(windows) <= MAX_TENSORS):
        return None
    if not all(isinstance(c, bytes) and len(c) == 32 for c in [*chunks, *windows]):
        return None
    return Manifest(fp, size, sha, tuple(lengths), tuple(chunks), tuple(windows), source, sig)


def make_manifest(fingerprint: str, size: int, sha256: bytes, lengths: Iterable[int], chunk_hashes: Iterable[bytes],
                  key: Ed25519PrivateKey, windows: Iterable[bytes] = ()) -> Manifest:  # fmt: skip
    return Manifest(fingerprint, size, sha256, tuple(lengths), tuple(chunk_hashes), tuple(windows)).signed_by(key)


def sources(records: Iterable[PeerRecord], me: NodeId, fp: str, reachable: Container[NodeId] | None = None
            ) -> list[NodeId]:  # fmt: skip
    """The members a fetch of the model ``fp`` may ask: those whose record says they serve it and hold its whole file
    (a partial copy has holes: it is no source), not ourselves, and (``reachable``) those we are connected to."""
    return [r.node for r in records if r.node != me and r.model is not None and r.model.fingerprint == fp and r.whole
            and (reachable is None or r.node in reachable)]  # fmt: skip


def vouchers(records: Iterable[PeerRecord], fp: str) -> set[NodeId]:
    """The members whose manifest of the model ``fp`` may decide what its bytes are: host-scoped (the mesh lets them
    run the model for everyone), not lite clients, holding the whole file."""
    return {r.node for r in records if r.scope >= Scope.HOST and r.role != Role.CLIENT and r.whole
            and r.model is not None and r.model.fingerprint == fp}  # fmt: skip


def believe(manifests: list[Manifest], vouchers: Container[NodeId], host: NodeId | None
            ) -> tuple[Manifest, list[NodeId]] | str:  # fmt: skip
    """The promise to believe and the sources that make it (any scope: they carry the bytes), or why there is none.
    Only ``vouchers``' manifests count: the elected ``host``'s where it sent one, else the one they all sign."""
    vouched = [m for m in manifests if m.source in vouchers]
    if not vouched:
        return "no host-scoped member that holds it whole sent its manifest"
    pick = next((m for m in vouched if m.source == host), None)
    if pick is None:
        if len({m.promise() for m in vouched}) > 1:
            who = ", ".join(sorted(crypto.short(m.source) for m in vouched))
            return f"the host-scoped members that hold it ({who}) vouch for different bytes"
        pick = vouched[0]
    return pick, sorted(m.source for m in manifests if m.promise() == pick.promise())


@dataclass
class Fetch:
    """Which chunk to ask which source for: every missing chunk once, the lowest first; one at a time from a source
    until its first chunk proved good, then IN_FLIGHT (so a source that lies costs one chunk, not IN_FLIGHT); a
    chunk that failed goes back in line, a source that lied or vanished takes no more."""

    manifest: Manifest
    have: set[int] = field(default_factory=set)  # chunks already on disk and checked (a resumed fetch)
    want: set[int] | None = None  # the chunks to fetch (None: all of them)
    asked: dict[int, NodeId] = field(default_factory=dict)  # chunk -> the source it is asked of now
    dropped: dict[NodeId, str] = field(default_factory=dict)  # source -> why
    proven: set[NodeId] = field(default_factory=set)  # sources that sent a good chunk

    def __post_init__(self) -> None:
        self.have = {i for i in self.have if 0 <= i < len(self.manifest.chunks)}
        if self.want is not None:
            self.want = {i for i in self.want if 0 <= i < len(self.manifest.chunks)}

    def next_for(self, source: NodeId) -> int | None:
        """The next chunk to ask ``source`` for, now marked asked (None: nothing for it now)."""
        most = IN_FLIGHT if source in self.proven else 1
        if source in self.dropped or sum(1 for s in self.asked.values() if s == source) >= most:
            return None
        for i in sorted(self.want) if self.want is not None else range(len(self.manifest.chunks)):
            if i not in self.have and i not in self.asked:
                self.asked[i] = source
                return i
        return None

    def arrived(self, source: NodeId, i: int, data: bytes) -> bool:
        """A chunk from ``source``: True when it is the one promised (keep it), False when it is not (the source
        is dropped, the chunk goes back in line)."""
        if self.asked.get(i) == source:
            del self.asked[i]
        if self.manifest.check(i, data):
            self.have.add(i)
            self.proven.add(source)
            return True
        self.drop(source, f"chunk {i} did not match its hash")
        return False

    def drop(self, source: NodeId, why: str) -> None:
        """``source`` lied, vanished or refused: what it was asked goes to the others."""
        self.dropped.setdefault(source, why)
        for i in [i for i, s in self.asked.items() if s == source]:
            del self.asked[i]

    def give_back(self, source: NodeId, i: int) -> None:
        """``source`` did not deliver chunk ``i`` (a timeout, a dropped stream): someone asks again."""
        if self.asked.get(i) == source:
            del self.asked[i]

    def done(self) -> bool:
        if self.want is not None:
            return self.want <= self.have
        return len(self.have) == len(self.manifest.chunks)

    def fetched_bytes(self) -> int:
        """Bytes of the wanted chunks on disk."""
        return sum(self.manifest.lengths[i] for i in self.have if self.want is None or i in self.want)

    def wanted_bytes(self) -> int:
        return self.manifest.size if self.want is None else sum(self.manifest.lengths[i] for i in self.want)
