"""Fetching a model file from the members that have it ([fetch]), pure: what a source promises (a signed manifest
of chunk hashes), which promise to believe when sources disagree, and which chunk to ask which source for next.
The shells (``serve/fetching.py``) move the bytes and keep the clock; nothing here does I/O.

A source's manifest names the file (its model fingerprint, size and whole-file SHA-256) and the SHA-256 of every
``chunk_size`` piece, signed with the source's node key: a signed lie is evidence against that member. The fetcher
asks every source for its manifest, believes the version most sources agree on, and checks each chunk on arrival:
a source that sends one bad chunk is dropped at once (its chunk goes to the others), so a liar costs at most one
chunk. The whole file's SHA-256 is checked at the end; nothing unchecked ever takes the model's name.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId

D_MANIFEST = b"mesh-llm manifest v1\0"
CHUNK = 8 << 20  # bytes per chunk: a 40 GB model is 5,000 chunks, its manifest 160 KB
MAX_CHUNKS = 1 << 20  # 8 TiB at the default size: anything larger is not a model we fetch
IN_FLIGHT = 4  # chunks asked of one source at a time, once it has sent one good chunk (one until then)


@dataclass(frozen=True)
class Manifest:
    fingerprint: str  # the model fingerprint (llama/gguf.py) the file has
    size: int
    sha256: bytes  # of the whole file
    chunk_size: int
    chunks: tuple[bytes, ...]  # SHA-256 of each piece, in order
    source: NodeId = b""
    sig: bytes = b""

    def body(self) -> bytes:
        return msgpack.packb([self.fingerprint, self.size, self.sha256, self.chunk_size, list(self.chunks)])

    def signed_by(self, key: Ed25519PrivateKey) -> Manifest:
        return Manifest(self.fingerprint, self.size, self.sha256, self.chunk_size, self.chunks,
                        crypto.node_id(key), crypto.sign(key, D_MANIFEST, self.body()))  # fmt: skip

    def encode(self) -> bytes:
        return msgpack.packb([self.body(), self.source, self.sig])

    def promise(self) -> bytes:
        """What two sources agree on when they agree (their manifests but for the signer)."""
        return hashlib.sha256(self.body()).digest()

    def span(self, i: int) -> tuple[int, int]:
        """Chunk ``i``'s offset and length."""
        off = i * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def check(self, i: int, data: bytes) -> bool:
        return 0 <= i < len(self.chunks) and len(data) == self.span(i)[1] and \
            hashlib.sha256(data).digest() == self.chunks[i]  # fmt: skip


def decode_manifest(raw: bytes, source: NodeId, fingerprint: str) -> Manifest | None:
    """A manifest from ``source`` for ``fingerprint``, signed by it and self-consistent; None for anything else."""
    try:
        outer = msgpack.unpackb(raw)
        body, signer, sig = outer
        fp, size, sha, chunk_size, chunks = msgpack.unpackb(body)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if signer != source or not isinstance(sig, bytes) or not crypto.verify(source, D_MANIFEST, body, sig):
        return None
    if fp != fingerprint or not isinstance(sha, bytes) or len(sha) != 32:
        return None
    if not (isinstance(size, int) and isinstance(chunk_size, int) and 0 < chunk_size <= 1 << 30 and size > 0):
        return None
    if not (isinstance(chunks, list) and len(chunks) == -(-size // chunk_size) <= MAX_CHUNKS):
        return None
    if not all(isinstance(c, bytes) and len(c) == 32 for c in chunks):
        return None
    return Manifest(fp, size, sha, chunk_size, tuple(chunks), source, sig)


def make_manifest(fingerprint: str, size: int, sha256: bytes, chunk_hashes: list[bytes], key: Ed25519PrivateKey,
                  chunk_size: int = CHUNK) -> Manifest:  # fmt: skip
    return Manifest(fingerprint, size, sha256, chunk_size, tuple(chunk_hashes)).signed_by(key)


def believe(manifests: list[Manifest]) -> tuple[Manifest, list[NodeId]] | None:
    """The promise most sources make (ties: the one whose sources sort first), and those sources."""
    if not manifests:
        return None
    votes = Counter(m.promise() for m in manifests)
    best = max(votes.values())
    pick = min((m for m in manifests if votes[m.promise()] == best), key=lambda m: (m.source,))
    return pick, sorted(m.source for m in manifests if m.promise() == pick.promise())


@dataclass
class Fetch:
    """Which chunk to ask which source for: every missing chunk once, the lowest first; one at a time from a source
    until its first chunk proved good, then IN_FLIGHT (so a source that lies costs one chunk, not IN_FLIGHT); a
    chunk that failed goes back in line, a source that lied or vanished takes no more."""

    manifest: Manifest
    have: set[int] = field(default_factory=set)  # chunks already on disk and checked (a resumed fetch)
    asked: dict[int, NodeId] = field(default_factory=dict)  # chunk -> the source it is asked of now
    dropped: dict[NodeId, str] = field(default_factory=dict)  # source -> why
    proven: set[NodeId] = field(default_factory=set)  # sources that sent a good chunk

    def __post_init__(self) -> None:
        self.have = {i for i in self.have if 0 <= i < len(self.manifest.chunks)}

    def next_for(self, source: NodeId) -> int | None:
        """The next chunk to ask ``source`` for, now marked asked (None: nothing for it now)."""
        most = IN_FLIGHT if source in self.proven else 1
        if source in self.dropped or sum(1 for s in self.asked.values() if s == source) >= most:
            return None
        for i in range(len(self.manifest.chunks)):
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
        return len(self.have) == len(self.manifest.chunks)

    def fetched_bytes(self) -> int:
        return sum(self.manifest.span(i)[1] for i in self.have)
