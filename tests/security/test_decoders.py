"""Fuzzing every decoder that takes bytes from the network (or a file the user was handed), with hypothesis.

Inputs are of two kinds: arbitrary values in every field of every message type the wire knows, and valid objects —
signed records, admission chains, revocations, tombstones, GGUF headers — with one part replaced. The property is
the same everywhere: the code answers with its own typed refusal (RemoteProtocolError, a refusal reason, a dropped
entry, a UserError for a file) or takes the input; anything else (a TypeError, an IndexError, a crash deep in a
handler) is a bug a peer could trigger at will. The patched C++ rpc-server's commands: test_rpc_fuzz.py.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.errors import RemoteProtocolError, UserError
from meshllm.llama.gguf import read_header
from meshllm.net.endpoint import parse_addr, try_addr
from meshllm.proto import admission as adm
from meshllm.proto import crypto, reach, wire
from meshllm.proto import signed as sgn
from meshllm.proto.auth import AuthHello, AuthProof, check_proof, rekey_refused
from meshllm.proto.gossip import GossipPush
from meshllm.proto.meshcore import MeshCore
from meshllm.proto.record import PeerRecord, Role, open_record, record_from_wire

NOW = 1_800_000_000.0
FOUNDER = crypto.new_key()
CHAIN = adm.found(FOUNDER, NOW)
MESH = CHAIN[0][0]
MEMBER = crypto.new_key()
M_ID = crypto.node_id(MEMBER)
M_CHAIN = adm.admit(FOUNDER, CHAIN, M_ID, NOW)
SECRET = os.urandom(32)

LEAF = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=24)
    | st.binary(max_size=96) | st.sampled_from([M_ID, MESH, crypto.node_id(FOUNDER), b"\0" * 64])
)  # fmt: skip
VALUES = st.recursive(LEAF, lambda c: st.lists(c, max_size=8) | st.dictionaries(st.text(max_size=8), c, max_size=8),
                      max_leaves=40)  # fmt: skip
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _core() -> MeshCore:
    """The founder's core with one member connected, told the wall time (admission checks on)."""
    core = MeshCore(key=FOUNDER, mesh_id=MESH, chain=CHAIN, incarnation=1, now=0.0)
    core.on_connected(M_ID, 0.0)
    rec = PeerRecord(node=M_ID, incarnation=1, seq=1, role=Role.WORKER, chain=tuple(M_CHAIN))
    core.on_message(M_ID, GossipPush(records=[rec.to_wire(MEMBER)]), 0.0)
    core.tick(0.5, NOW + 1)
    return core


@FUZZ
@given(st.sampled_from(sorted(wire._REGISTRY)), st.data())
def test_every_message_type_with_arbitrary_fields_reaches_its_handler_safely(kind: str, data: st.DataObject) -> None:
    import dataclasses

    cls = wire._REGISTRY[kind]
    obj: dict[str, Any] = {"@": kind}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if data.draw(st.booleans()):
            obj[f.name] = data.draw(VALUES)
    try:
        msg = wire.decode_one(wire.pack(obj))
    except RemoteProtocolError:
        return
    # what each kind of message meets on a real node: the mesh core (gossip, renewal, pings), the auth check, a
    # rendezvous for punch requests
    _core().on_message(M_ID, msg, 1.0)
    if isinstance(msg, AuthProof):
        hello = AuthHello(dialler=M_ID, listener=crypto.node_id(FOUNDER), mesh_id=MESH)
        v = check_proof(key=FOUNDER, my_chain=CHAIN, mesh_id=MESH, secret=SECRET, hello=hello, nonce=b"n" * 32,
                        proof=msg, scope_of=lambda n: None, now=NOW)  # fmt: skip
        assert not v.ok  # nothing drawn at random proves anything
    if isinstance(msg, reach.PunchRequest):
        reach.rendezvous(M_ID, ["127.0.0.1:1"], [], msg)
    if isinstance(msg, wire._REGISTRY["mesh.rekey"]):
        assert rekey_refused(msg, MESH) is not None  # type: ignore[arg-type]


@FUZZ
@given(st.text(max_size=12), VALUES)
def test_a_signed_record_with_any_field_replaced_is_taken_or_dropped(field: str, value: object) -> None:
    """Signed by a member (so the signature holds): what the fields say must still be checked one by one."""
    good = PeerRecord(node=M_ID, incarnation=1, seq=5, role=Role.WORKER, chain=tuple(M_CHAIN))
    _, _, d = open_record(good.to_wire(MEMBER))
    d = {**d, (field or "role"): value}
    b = wire.pack(d)
    raw = wire.pack([b, crypto.sign(MEMBER, crypto.D_RECORD, b)])
    with contextlib.suppress(RemoteProtocolError):
        record_from_wire(raw, MESH)
    res = _core().table.merge_push(GossipPush(records=[raw]), 1.0)
    assert isinstance(res.dropped, list)


RECORD_FIELDS = sorted(open_record(PeerRecord(node=M_ID, incarnation=1, seq=1).to_wire(MEMBER))[2])


@FUZZ
@given(st.sampled_from(RECORD_FIELDS), VALUES)
def test_each_known_record_field_with_a_wrong_value_is_refused_cleanly(field: str, value: object) -> None:
    good = PeerRecord(node=M_ID, incarnation=1, seq=5, role=Role.WORKER, chain=tuple(M_CHAIN))
    _, _, d = open_record(good.to_wire(MEMBER))
    b = wire.pack({**d, field: value})
    raw = wire.pack([b, crypto.sign(MEMBER, crypto.D_RECORD, b)])
    core = _core()
    core.table.merge_push(GossipPush(records=[raw]), 1.0)
    core.alive(1.0)
    core.elected_host(1.0)


@FUZZ
@given(st.integers(0, 1), st.integers(0, 6), VALUES)
def test_an_admission_chain_with_one_part_replaced_is_refused_cleanly(i: int, j: int, value: object) -> None:
    chain: list[list[object]] = [list(link) for link in M_CHAIN]
    chain[i][j] = value
    try:
        parsed = adm.chain_from_wire(chain)
    except RemoteProtocolError:
        return
    why = adm.verify_chain(parsed, M_ID, MESH, NOW)
    if why is None:  # only a change that leaves the signed bytes equal can pass
        assert adm.chain_to_wire(parsed) == adm.chain_to_wire(M_CHAIN)
    adm.cut_off(parsed, {M_ID})
    adm.chain_until(parsed)
    with pytest.raises(ValueError):
        adm.renew(FOUNDER, CHAIN, M_ID, parsed, MESH, {M_ID}, NOW)


@FUZZ
@given(st.lists(VALUES, min_size=5, max_size=5), st.integers(0, 4))
def test_revocations_and_tombstones_of_any_shape_are_refused_cleanly(values: list[object], keep: int) -> None:
    good = sgn.revoke(FOUNDER, MESH, M_ID, NOW).to_wire()
    mixed = [*good[:keep], *values[keep:]]
    for obj in (values, mixed):
        with contextlib.suppress(RemoteProtocolError):
            sgn.revocation_from_wire(obj, MESH)
    core = _core()
    res = core.table.merge_push(GossipPush(tombstones=[values, mixed], revocations=[values, mixed]), 1.0)
    assert isinstance(res.dropped, list)


@FUZZ
@given(st.binary(max_size=200))
def test_datagrams_that_are_not_quic(data: bytes) -> None:
    p = reach.parse_probe(data)
    if p is not None:
        assert not reach.probe_is_from(data, M_ID) or data[1 : 1 + 32] == p[1]
    reach.parse_relay(data)
    reach.relay_forward(data, ("127.0.0.1", 1), {("127.0.0.1", 1): (M_ID, bytes(8))},
                        {M_ID: (("127.0.0.1", 2), b"t" * 8)})  # fmt: skip


@FUZZ
@given(st.text(max_size=80))
def test_addresses_from_peers(text: str) -> None:
    try:
        _host, port = parse_addr(text)
        assert 0 < port < 65536
    except ValueError:
        pass
    try_addr(text)
    reach.parse_relayed_addr((text, 0))


@pytest.fixture(scope="module")
def gguf_head(tiny_model: Path) -> bytes:
    """The tiny model's header and tensor table (and some weights after them)."""
    hdr = read_header(tiny_model)
    with tiny_model.open("rb") as f:
        return f.read(hdr.data_offset + 4096)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=8), st.integers(0, 2**22))
def test_a_gguf_file_with_bytes_changed_or_cut_is_one_clear_error(
    gguf_head: bytes, tmp_path_factory: pytest.TempPathFactory, flips: list[tuple[int, int]], cut: int
) -> None:
    """A model file is input too (downloaded, or handed over by someone): a damaged one is one clear line."""
    data = bytearray(gguf_head[: max(4, cut)] if cut < len(gguf_head) else gguf_head)
    for pos, byte in flips:
        if data:
            data[pos % min(len(data), 4096)] = byte  # the header's fixed part, counts and the first keys
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    path.write_bytes(bytes(data))
    try:
        read_header(path)
    except UserError as e:
        assert "\n" not in str(e)
