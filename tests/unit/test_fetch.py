"""The pure core of fetching a model from peers: signed manifests, which promise to believe, which chunk to ask
of whom, and a lying source caught at its first bad chunk."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from meshllm.proto import crypto
from meshllm.proto import fetch as f

FP = "ab" * 32
KEYS = [crypto.new_key() for _ in range(3)]
A, B, C = (crypto.node_id(k) for k in KEYS)
PEER = crypto.node_id(crypto.new_key())
SIZE, CH = 10_000, 1_000
DATA = os.urandom(SIZE)


def manifest(key: crypto.Ed25519PrivateKey, data: bytes = DATA) -> f.Manifest:
    chunks = [hashlib.sha256(data[i : i + CH]).digest() for i in range(0, len(data), CH)]
    return f.make_manifest(FP, len(data), hashlib.sha256(data).digest(), f.tile(len(data), (), CH), chunks, key)


def test_a_manifest_is_signed_by_its_source_and_checked_whole() -> None:
    m = manifest(KEYS[0])
    assert f.decode_manifest(m.encode(), A, FP) == m
    assert f.decode_manifest(m.encode(), B, FP) is None  # said to be from another member
    assert f.decode_manifest(m.encode(), A, "cd" * 32) is None  # for another model
    forged = f.Manifest(FP, SIZE, m.sha256, m.lengths, (bytes(32), *m.chunks[1:]), (), A, m.sig)
    assert f.decode_manifest(forged.encode(), A, FP) is None  # altered after signing
    short = f.make_manifest(FP, SIZE, m.sha256, m.lengths, m.chunks[:-1], KEYS[0])
    assert f.decode_manifest(short.encode(), A, FP) is None  # a chunk missing for its size
    off = f.make_manifest(FP, SIZE, m.sha256, (*m.lengths[:-1], CH - 1), m.chunks, KEYS[0])
    assert f.decode_manifest(off.encode(), A, FP) is None  # lengths that do not tile the file
    empty = f.make_manifest(FP, SIZE, m.sha256, (0, *m.lengths), (bytes(32), *m.chunks), KEYS[0])
    assert f.decode_manifest(empty.encode(), A, FP) is None  # an empty chunk
    assert m.span(9) == (9000, 1000) and m.check(3, DATA[3000:4000]) and not m.check(3, DATA[3000:3999])


@given(st.binary(max_size=300))
def test_decoding_a_manifest_never_raises(raw: bytes) -> None:
    assert f.decode_manifest(raw, A, FP) is None


def test_only_host_scoped_holders_decide_what_is_believed_and_no_vote_or_id_breaks_a_tie() -> None:
    """A member below host scope carries bytes and decides nothing; the host's manifest wins; vouchers
    that disagree (no host among them) stop the fetch; how many keys sign a lie, or how they sort, changes nothing."""
    bad = bytearray(DATA)
    bad[5] ^= 1
    good_a, liar_b, good_c = manifest(KEYS[0]), manifest(KEYS[1], bytes(bad)), manifest(KEYS[2])
    # the liar (B) is no voucher: however its id sorts and however many sign with it, A's promise is believed
    for host in (A, None):
        got = f.believe([liar_b, good_a], {A}, host)
        assert not isinstance(got, str) and got[0] == good_a and got[1] == [A]
    m2 = manifest(KEYS[1])  # B carrying the believed bytes: a source of them, deciding nothing
    got = f.believe([m2, good_a], {A}, None)
    assert not isinstance(got, str) and got[1] == sorted([A, B])
    # no voucher answered: nothing believed (before: the client-scoped liar's manifest, alone, was)
    assert isinstance(f.believe([liar_b], {A}, A), str)
    assert isinstance(f.believe([], {A}, A), str)
    # two vouchers disagree: the elected host's promise, else none (before: a tie went to the lowest node id)
    got = f.believe([liar_b, good_a], {A, B}, A)
    assert not isinstance(got, str) and got[0] == good_a
    got = f.believe([liar_b, good_a], {A, B}, B)
    assert not isinstance(got, str) and got[0] == liar_b
    assert "vouch for different bytes" in str(f.believe([liar_b, good_a, good_c], {A, B, C}, None))
    got = f.believe([good_c, good_a], {A, C}, None)  # agreeing vouchers, no host answered
    assert not isinstance(got, str) and got[1] == sorted([A, C])


def test_vouchers_are_host_scoped_members_holding_the_whole_file() -> None:
    from meshllm.proto import admission as adm
    from meshllm.proto import token as tok
    from meshllm.proto.record import ModelFacts, PeerRecord, Role

    founder = KEYS[0]
    chain = adm.found(founder, 0.0)
    facts = ModelFacts(FP, SIZE, 1, "m")

    def rec(key: crypto.Ed25519PrivateKey, scope: tok.Scope, **kw: object) -> PeerRecord:
        me = crypto.node_id(key)
        c = chain if key is founder else adm.admit(founder, chain, me, 0.0, scope)
        return PeerRecord(me, 1, 1, model=facts, chain=tuple(c), **kw)  # type: ignore[arg-type]

    recs = [rec(KEYS[0], tok.Scope.HOST), rec(KEYS[1], tok.Scope.WORKER), rec(KEYS[2], tok.Scope.CLIENT)]
    assert f.vouchers(recs, FP) == {A}
    host_b = rec(KEYS[1], tok.Scope.HOST)
    assert f.vouchers([host_b], FP) == {B} and f.vouchers([host_b], "cd" * 32) == set()
    assert f.vouchers([rec(KEYS[1], tok.Scope.HOST, held=((0, 1),))], FP) == set()  # a partial copy
    assert f.vouchers([rec(KEYS[1], tok.Scope.HOST, role=Role.CLIENT)], FP) == set()


def test_a_fingerprint_names_a_file_only_as_64_hex_digits() -> None:
    """A fingerprint is used as a file name; a record or manifest with anything else is refused."""
    from meshllm.proto.record import is_fingerprint

    assert is_fingerprint(FP) and is_fingerprint("0123456789abcdef" * 4)
    for bad in ("../" * 21 + "x", "AB" * 32, "ab" * 31, "ab" * 33, "/tmp/" + "a" * 59, 7, None, "g" * 64):
        assert not is_fingerprint(bad), bad
    evil = "../../../../tmp/owned" + "0" * 43
    m = f.make_manifest(evil, SIZE, hashlib.sha256(DATA).digest(), f.tile(SIZE, (), CH),
                        [hashlib.sha256(DATA[i : i + CH]).digest() for i in range(0, SIZE, CH)], KEYS[0])  # fmt: skip
    assert f.decode_manifest(m.encode(), A, evil) is None


def test_a_manifest_chunk_longer_than_chunk_is_refused() -> None:
    """A chunk is read into memory whole: a manifest promising one over CHUNK (1 GiB was accepted) is refused."""
    size = f.CHUNK + 1
    big = f.make_manifest(FP, size, bytes(32), (size,), (bytes(32),), KEYS[0])
    assert f.decode_manifest(big.encode(), A, FP) is None
    ok = f.make_manifest(FP, size, bytes(32), (f.CHUNK, 1), (bytes(32), bytes(32)), KEYS[0])
    assert f.decode_manifest(ok.encode(), A, FP) == ok


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

    from meshllm.serve.fetch.pull import _WholeHash

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


def test_chunks_follow_the_file_layout_and_stay_bounded() -> None:
    assert f.tile(100, (), 30) == (30, 30, 30, 10)
    assert f.tile(100, (40, 0, 100, 250, 40), 30) == (30, 10, 30, 30)  # a cut at 40; the ends are no cuts
    # header to 64; layer 0's tensors at 64 and 80; a layerless one between layer 0 and 1; layer 1 at 200
    cuts = f.layout_cuts(64, [(80, 20, 0), (200, 50, 1), (64, 16, 0), (100, 100, None)])
    assert cuts == [64, 100, 200]
    assert f.tile(250, cuts, 60) == (60, 4, 36, 60, 40, 50)


def test_the_chunks_covering_byte_ranges() -> None:
    m = f.make_manifest(FP, 100, bytes(32), (10, 20, 30, 40), [bytes(32)] * 4, KEYS[0])
    assert m.starts == (0, 10, 30, 60)
    assert m.covering([(0, 10)]) == {0} and m.covering([(9, 2)]) == {0, 1} and m.covering([(30, 30)]) == {2}
    assert m.covering([(59, 1), (99, 1), (5, 0)]) == {2, 3} and m.covering([]) == set()


def test_a_partial_fetch_asks_only_for_the_wanted_chunks() -> None:
    plan = f.Fetch(manifest(KEYS[0]), have={3}, want={3, 5, 7})
    assert plan.next_for(A) == 5 and plan.arrived(A, 5, DATA[5000:6000]) and not plan.done()
    assert plan.next_for(A) == 7 and plan.next_for(A) is None  # nothing else: only what is wanted
    assert plan.arrived(A, 7, DATA[7000:8000]) and plan.done()
    assert plan.fetched_bytes() == plan.wanted_bytes() == 3000


def test_a_tensor_s_sampled_bytes_are_checked_against_the_promise() -> None:
    w = [hashlib.sha256(b"abc").digest(), hashlib.sha256(b"xyz").digest()]
    m = f.make_manifest(FP, SIZE, bytes(32), f.tile(SIZE, (), CH), [bytes(32)] * 10, KEYS[0], w)
    assert f.decode_manifest(m.encode(), A, FP) == m
    assert m.check_window(1, b"xyz") and not m.check_window(0, b"xyz") and not m.check_window(2, b"abc")


def test_a_source_s_manifest_follows_the_gguf_layout_and_its_samples_are_the_fingerprint_s(tmp_path: Path) -> None:
    """A source's chunks: the header alone, then a chunk wherever a layer's tensors begin (so a worker's layers are
    whole chunks); its "windows" answer the sampled bytes of the tensors asked, in order, and nothing out of bounds."""
    from meshllm.llama.gguf import layer_of, read_header, sampled
    from meshllm.serve.fetch.sharing import WINDOWS_MAX, Sharing
    from tests.gguf_files import write_gguf

    model = write_gguf(tmp_path / "m.gguf", layers=3)
    data, hdr = model.read_bytes(), read_header(model)
    s = Sharing(KEYS[0], tmp_path, lambda: {FP: model})
    m = asyncio.run(s.manifest(FP, model))
    assert f.decode_manifest(m.encode(), A, FP) == m and m.size == len(data) and sum(m.lengths) == len(data)
    assert m.span(0) == (0, hdr.data_offset)  # the header, alone
    for layer in range(3):  # each layer's tensors begin a chunk, and no chunk holds two layers' tensors
        first = min(t.offset for t in hdr.tensors if layer_of(t.name) == layer)
        assert first in m.starts
    for i, (off, n) in enumerate(zip(m.starts, m.lengths, strict=True)):
        assert m.check(i, data[off : off + n])
        assert len({layer_of(t.name) for t in hdr.tensors if off <= t.offset < off + n}) <= 1
    got = asyncio.run(s.windows(PEER, FP, model, [1, 3]))
    want = [b"".join(data[o : o + n] for o, n in sampled(hdr.tensors[t])) for t in (1, 3)]
    assert got == b"".join(want) and m.check_window(1, want[0]) and m.check_window(3, want[1])
    for bad in ([], [len(hdr.tensors)], [-1], [True], "1", [0] * (WINDOWS_MAX + 1)):
        assert asyncio.run(s.windows(PEER, FP, model, bad)) is None, bad


def test_only_members_with_the_whole_file_are_sources() -> None:
    from meshllm.proto.record import ModelFacts, PeerRecord

    facts, other = ModelFacts(FP, 1, 1, "m"), ModelFacts("cd" * 32, 1, 1, "n")
    recs = [PeerRecord(A, 1, 1, model=facts), PeerRecord(B, 1, 1, model=facts, held=((0, 4),)),
            PeerRecord(C, 1, 1, model=other), PeerRecord(PEER, 1, 1, model=facts), PeerRecord(bytes(32), 1, 1)]
    assert f.sources(recs, PEER, FP) == [A]  # not a partial copy, another model, ourselves, a node with no model
    assert f.sources(recs, bytes(32), FP, reachable={PEER}) == [PEER]
