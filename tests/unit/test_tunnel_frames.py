"""The tunnel's frame decoder: whatever chunks QUIC hands it, the DATA bytes and the credits come out whole and in
order, a DATA frame's bytes as they arrive (not held until the frame is complete), and a bad header is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.errors import RemoteProtocolError
from meshllm.net.tunnel import CREDIT, CREDIT_FRAME, DATA, HDR, MAX_FRAME, _Decoder

frames = st.lists(st.one_of(st.binary(max_size=3000).map(lambda b: (DATA, b)),
                            st.integers(0, 2**32 - 1).map(lambda n: (CREDIT, n))), max_size=12)  # fmt: skip


def _encode(items: list[tuple[int, object]]) -> bytes:
    out = b""
    for typ, v in items:
        if typ == DATA:
            assert isinstance(v, bytes)
            out += HDR.pack(DATA, len(v)) + v
        else:
            assert isinstance(v, int)
            out += CREDIT_FRAME.pack(CREDIT, 4, v)
    return out


@settings(max_examples=300, deadline=None)
@given(frames, st.lists(st.integers(1, 4000), max_size=40))
def test_any_chunking_gives_the_same_bytes_and_credits(items: list[tuple[int, object]], cuts: list[int]) -> None:
    wire = _encode(items)
    dec = _Decoder()
    data, credits, i = b"", [], 0
    for size in [*cuts, len(wire)]:
        for typ, payload in dec.feed(wire[i : i + size]):
            if typ == DATA:
                assert len(payload) > 0
                data += bytes(payload)
            else:
                credits.append(int.from_bytes(payload, "big"))
        i += size
        if i >= len(wire):
            break
    assert data == b"".join(v for t, v in items if t == DATA)  # type: ignore[misc]
    assert credits == [v for t, v in items if t == CREDIT]
    assert dec.typ < 0 and dec.head == b""  # between frames at the end


def test_data_is_passed_on_before_its_frame_is_whole() -> None:
    dec = _Decoder()
    assert dec.feed(HDR.pack(DATA, 10) + b"abc") == [(DATA, b"abc")]
    assert dec.feed(b"defg") == [(DATA, b"defg")]
    assert dec.feed(b"hij" + HDR.pack(DATA, 1)) == [(DATA, b"hij")]
    assert dec.feed(b"z") == [(DATA, b"z")]


@pytest.mark.parametrize(
    "header",
    [HDR.pack(7, 5), HDR.pack(DATA, MAX_FRAME + 1), HDR.pack(CREDIT, 8), HDR.pack(CREDIT, 0)],
    ids=["unknown type", "over MAX_FRAME", "long credit", "empty credit"],
)
def test_a_bad_header_is_refused_before_its_payload(header: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="bad tunnel frame"):
        _Decoder().feed(header)
    dec = _Decoder()  # split across chunks: checked once whole
    assert dec.feed(header[:3]) == []
    with pytest.raises(RemoteProtocolError):
        dec.feed(header[3:])
