"""[fetch] The pure core of fetching a model from peers: signed manifests, which promise to believe, which chunk to ask
of whom, and a lying source caught at its first bad chunk."""

from __future__ import annotations

import hashlib
import os

from hypothesis import given
from hypothesis import strategies as st

from meshllm.proto import crypto
from meshllm.proto import fetch as f

FP = "ab" * 32
KEYS = [crypto.new_key() for _ in range(3)]
A, B, C = (crypto.node_id(k) for k in KEYS)
SIZE, CH = 10_000, 1_000
DATA = os.urandom(SIZE)


def manifest(key: crypto.Ed25519PrivateKey, data: bytes = DATA) -> f.Manifest:
    chunks = [hashlib.sha256(data[i : i + CH]).digest() for i in range(0, len(data), CH)]
    return f.make_manifest(FP, len(data), hashlib.sha256(data).digest(), chunks, key, chunk_size=CH)


def test_a_manifest_is_signed_by_its_source_and_checked_whole() -> None:
    m = manifest(KEYS[0])
    assert f.decode_manifest(m.encode(), A, FP) == m
    assert f.decode_manifest(m.encode(), B, FP) is None  # said to be from another member
    assert f.decode_manifest(m.encode(), A, "cd" * 32) is None  # for another model
    forged = f.Manifest(FP, SIZE, m.sha256, CH, (bytes(32), *m.chunks[1:]), A, m.sig)
    assert f.decode_manifest(forged.encode(), A, FP) is None  # altered after signing
    short = f.make_manifest(FP, SIZE, m.sha256, list(m.chunks[:-1]), KEYS[0], chunk_size=CH)
    assert f.decode_manifest(short.encode(), A, FP) is None  # a chunk missing for its size
    assert m.span(9) == (9000, 1000) and m.check(3, DATA[3000:4000]) and not m.check(3, DATA[3000:3999])


@given(st.binary(max_size=300))
def test_decoding_a_manifest_never_raises(raw: bytes) -> None:
    assert f.decode_manifest(raw, A, FP) is None


def test_the_promise_most_sources_make_is_believed() -> None:
    bad = bytearray(DATA)
    bad[5] ^= 1
    honest, liar = [manifest(KEYS[0]), manifest(KEYS[2])], manifest(KEYS[1], bytes(bad))
    m, who = f.believe([*honest, liar])  # type: ignore[misc]
    assert m.promise() == honest[0].promise() and who == sorted([A, C])
    assert f.believe([]) is None
    one, two = f.believe([liar, honest[0]]), f.believe([honest[0], liar])  # a tie: the same pick either way
    assert one is not None and two is not None and one[0].source == two[0].source == min(A, B)


def test_chunks_are_shared_out_lowest_first_and_bounded_per_source() -> None:
    plan = f.Fetch(manifest(KEYS[0]), have={0, 1, 99})
    assert plan.have == {0, 1}  # a chunk that does not exist is not kept
    assert [plan.next_for(A), plan.next_for(A)] == [2, None]  # one at a time until a chunk of its proved good
    assert plan.arrived(A, 2, DATA[2000:3000])
    got = [plan.next_for(A) for _ in range(f.IN_FLIGHT + 1)]
    assert got == [3, 4, 5, 6, None]
    assert plan.next_for(B) == 7
    plan.give_back(A, 4)  # a timeout: asked again, by anyone
    assert plan.next_for(C) == 4


def test_a_lying_source_costs_one_chunk_and_the_fetch_completes() -> None:
    plan = f.Fetch(manifest(KEYS[0]))
    sent = {A: 0, B: 0, C: 0}
    while not plan.done():
        progressed = False
        for src in (A, B, C):
            i = plan.next_for(src)
            if i is None:
                continue
            progressed = True
            off, n = plan.manifest.span(i)
            data = DATA[off : off + n] if src != B else bytes(n)  # B sends zeros
            sent[src] += 1
            plan.arrived(src, i, data)
        assert progressed
    assert sent[B] == 1 and B in plan.dropped and "chunk" in plan.dropped[B]
    assert plan.fetched_bytes() == SIZE and plan.next_for(B) is None


def test_a_source_that_vanishes_gives_its_chunks_back() -> None:
    plan = f.Fetch(manifest(KEYS[0]))
    plan.proven |= {A, B}
    mine = [plan.next_for(A) for _ in range(3)]
    plan.drop(A, "stopped answering")
    assert not plan.asked and plan.next_for(A) is None
    assert [plan.next_for(B) for _ in range(3)] == mine


def test_the_whole_file_hash_follows_the_chunks_on_disk_in_order(tmp_path: object) -> None:
    """The fetch hashes the file as its chunks land (in file order, whatever order they came in), not again at the
    end; its digest exists only once every chunk went in."""
    import asyncio
    from pathlib import Path

    from meshllm.serve.fetching import _WholeHash

    m = manifest(KEYS[0])
    path = Path(str(tmp_path)) / "part"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    try:

        async def run() -> None:
            whole = _WholeHash(m, fd)
            await whole.advance({1, 2, 3})  # chunk 0 not there yet: nothing can go in
            assert whole.next == 0 and whole.digest() is None
            await whole.advance({0, 1, 2, 3, 5})
            assert whole.next == 4 and whole.digest() is None
            await whole.advance(set(range(len(m.chunks))))
            assert whole.digest() == m.sha256

        asyncio.run(run())
    finally:
        os.close(fd)
