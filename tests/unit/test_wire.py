"""Frames and messages: a value or RemoteProtocolError, nothing else, never buffering past the cap."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.errors import LocalProtocolError, RemoteProtocolError
from meshllm.proto.auth import AuthHello, AuthProof
from meshllm.proto.gossip import GossipPush, Ping
from meshllm.proto.wire import FrameDecoder, Message, encode, pack

CAP = 4096


def test_round_trip_whole_and_byte_by_byte() -> None:
    msgs: list[Message] = [
        Ping(t=1.5),
        AuthHello(dialler=b"a" * 32, listener=b"b" * 32, mesh_id=b"m" * 16),
        AuthProof(sig=b"s" * 64, proof=b"p" * 32, token="mesh1.xyz"),
        GossipPush(records=[b"r1", b"r2"], tombstones=[[b"n", 1, b"b", 2, b"s"]]),
    ]
    data = b"".join(encode(m) for m in msgs)
    assert FrameDecoder().feed(data) == msgs
    d = FrameDecoder()
    got: list[Message] = []
    for i in range(len(data)):
        got += d.feed(data[i : i + 1])
    assert got == msgs and d.buffered == 0


def test_oversized_frame_is_refused_at_its_header() -> None:
    d = FrameDecoder(max_frame=CAP)
    with pytest.raises(RemoteProtocolError, match="exceeds the cap"):
        d.feed(struct.pack(">I", CAP + 1))
    assert d.buffered == 0
    with pytest.raises(LocalProtocolError):
        encode(GossipPush(records=[b"x" * CAP]), max_frame=CAP)


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2],  # not a map
        {"@": "nope"},  # unknown type
        {"@": "ping"},  # missing field
        {"@": "ping", "t": "1"},
        {"@": "ping", "t": True},
        {"@": "auth.hello", "dialler": "text", "listener": b"", "mesh_id": b""},  # wrong field type
        {"@": "gossip.push", "records": [1, 2]},
    ],
)
def test_bad_messages_are_remote_protocol_errors(obj: object) -> None:
    body = pack(obj)
    with pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(struct.pack(">I", len(body)) + body)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_whole(data: bytes) -> None:
    d = FrameDecoder(max_frame=CAP)
    try:
        out = d.feed(data)
    except RemoteProtocolError:
        return
    assert all(isinstance(m, Message) for m in out)
    assert d.buffered <= CAP + 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=30))
def test_arbitrary_bytes_in_pieces(chunks: list[bytes]) -> None:
    d = FrameDecoder(max_frame=CAP)
    for c in chunks:
        try:
            for m in d.feed(c):
                assert isinstance(m, Message)
        except RemoteProtocolError:
            return
        assert d.buffered <= CAP + 4


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(allow_nan=False)
        | st.text()
        | st.binary(),
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
        max_leaves=12,
    )
)
def test_arbitrary_msgpack_values(value: object) -> None:
    for obj in (value, {"@": "auth.proof", "sig": value, "proof": b""}, {"@": "gossip.push", "records": value}):
        body = pack(obj)
        try:
            out = FrameDecoder().feed(struct.pack(">I", len(body)) + body)
        except RemoteProtocolError:
            continue
        assert len(out) == 1 and isinstance(out[0], Message)
