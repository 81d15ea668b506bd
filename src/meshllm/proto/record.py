"""A node's signed peer record, pure: what it says of itself (role, state, model and layers, memory, addresses, slots,
its admission chain), signed with its key and ordered by (incarnation, seq), and its checked decoding from the wire
(``record_from_wire``: every field's type and bound, the signature, the chain) — a record that fails any check is a
``RemoteProtocolError``. Gossip (``gossip.py``) carries and merges them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypedDict, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import RemoteProtocolError
from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.wire import pack, unpack

MAX_RECORD = 16 * 1024


MAX_RECORDS = 256


MAX_NAME = 32


HEX = frozenset("0123456789abcdef")


def is_fingerprint(v: object) -> bool:
    """A model fingerprint as llama/gguf.py writes it: 64 lowercase hex digits. A fetch names files on disk after it
    (a member once made a joiner write ``<any path>.part``), so a record with anything else is refused."""
    return isinstance(v, str) and len(v) == 64 and set(v) <= HEX


@dataclass(frozen=True)
class ModelFacts:
    fingerprint: str  # hex, see llama/gguf.py
    size: int  # bytes on disk
    n_layer: int
    source: str  # file name, catalog name or hub reference


class Role(StrEnum):
    """What a node is in the mesh (its record says; the election decides who is host)."""

    WORKER = "worker"
    HOST = "host"
    CLIENT = "client"  # a lite client: no model, no capacity


class NodeState(StrEnum):
    """Where a node is in its life, as its record says (peers route requests only to a SERVING host)."""

    STARTING = "starting"
    READY = "ready"
    LOADING = "loading"  # its llama-server is (re)starting
    SERVING = "serving"
    LEAVING = "leaving"


class RecordUpdate(TypedDict, total=False):
    """The fields of its own record a node may change (``MeshCore.update``); the rest (id, incarnation, seq,
    chain) only the core sets."""

    role: Role
    name: str
    addrs: tuple[str, ...]
    capacity: int
    device: str
    shares: tuple[int, ...]
    model: ModelFacts | None
    state: NodeState
    version: str
    rtt_ms: dict[NodeId, float]
    links: dict[NodeId, str]
    relay: bool
    reflexive: tuple[str, ...]
    host: NodeId | None
    planned: tuple[NodeId, ...]
    served: tuple[int, int]
    progress: int
    ttft: tuple[int, int]
    slots: tuple[int, int, int, int]
    why: str
    layers: tuple[tuple[int, int], ...]
    rate: float
    held: tuple[tuple[int, int], ...] | None
    replica: bool
    left: bool
    ram: int


@dataclass(frozen=True)
class PeerRecord:
    node: NodeId
    incarnation: int
    seq: int
    role: Role = Role.WORKER
    name: str = ""  # for people: --name, else the hostname
    addrs: tuple[str, ...] = ()
    capacity: int = 0  # bytes usable for the model: VRAM, or RAM on CPU nodes, measured at start
    device: str = "cpu"
    shares: tuple[int, ...] = ()  # several devices: each one's part of capacity, in llama.cpp's device order
    model: ModelFacts | None = None
    state: NodeState = NodeState.STARTING
    version: str = ""
    rtt_ms: dict[NodeId, float] = field(default_factory=dict)  # peer -> RTT as this node measured it
    links: dict[NodeId, str] = field(default_factory=dict)  # peer -> "direct" or "relay <short id>" (for people)
    relay: bool = False  # relays datagrams between members (publicly reachable, or --relay-server)
    reflexive: tuple[str, ...] = ()  # of addrs, those members see this node at behind a NAT (dial only after punching)
    host: NodeId | None = None  # who this node believes hosts its model
    planned: tuple[NodeId, ...] = ()  # a host: the nodes of the plan it runs (every node prefers them when planning)
    chain: tuple[adm.Link, ...] = ()
    left: bool = False  # a clean leave: this record is the node's own tombstone
    at: int = 0  # wall time of signing (unix s; 0: unknown, then its age is not checked)
    served: tuple[int, int] = (0, 0)  # a host: tokens its llama-server generated and prompt tokens it processed
    progress: int = -1  # a host whose model loads: percent loaded (-1: not loading, or not known)
    ttft: tuple[int, int] = (0, 0)  # requests through this node's API, and their summed time to first token (ms)
    slots: tuple[int, int, int, int] = (0, 0, 0, 0)  # a host: slots busy, slots in all, requests waiting, context
    why: str = ""  # a host that cannot serve: why ("waiting for more peers — need …"), so every node says the same
    layers: tuple[tuple[int, int], ...] = ()  # a host: each planned node's layers (first, count), as ``planned``
    rate: float = 0.0  # a host: tokens per second its llama-server generates now (running requests counted)
    held: tuple[tuple[int, int], ...] | None = None  # a partial copy of its model: the layers it holds (first,
    # count); None: the whole file. A partial copy is never elected host, nor a source of the model's file
    ram: int = 0  # bytes of RAM offered beside ``capacity`` for a model's routed experts (--max-ram)
    replica: bool = False  # a host of its model beside the elected one (a node its plan does not use, which
    # holds the whole model alone); never the sitting host of an election

    @property
    def whole(self) -> bool:
        """Whether this node holds its model's whole file (it may host, and others may fetch from it)."""
        return self.held is None

    @property
    def scope(self) -> tok.Scope:
        """What its admission chain lets this node do (a record without one is a client: it may do nothing else)."""
        return adm.chain_scope(self.chain)

    def to_wire(self, key: Ed25519PrivateKey) -> bytes:
        body = pack(
            {
                "node": self.node, "inc": self.incarnation, "seq": self.seq, "role": self.role,
                "addrs": list(self.addrs), "cap": self.capacity, "dev": self.device,
                "shares": list(self.shares), "name": self.name,
                "model": dataclasses.asdict(self.model) if self.model else None, "state": self.state,
                "ver": self.version, "rtt": self.rtt_ms, "links": self.links, "relay": self.relay,
                "nat": list(self.reflexive), "host": self.host, "planned": list(self.planned),
                "chain": adm.chain_to_wire(list(self.chain)), "left": self.left, "at": self.at,
                "srv": list(self.served), "prog": self.progress, "ttft": list(self.ttft),
                "slots": list(self.slots),
                "why": self.why, "lyr": [list(x) for x in self.layers], "rate": self.rate,
                **({"held": [list(x) for x in self.held]} if self.held is not None else {}),
                **({"rep": True} if self.replica else {}),
                **({"ram": self.ram} if self.ram else {}),
            }
        )  # fmt: skip
        return pack([body, crypto.sign(key, crypto.D_RECORD, body)])


E = TypeVar("E", bound=StrEnum)


def _enum(d: dict[str, Any], k: str, tp: type[E]) -> E:
    v = _field(d, k, str)
    try:
        return tp(v)
    except ValueError:
        raise RemoteProtocolError(f"record field {k}: unknown value {v[:20]!r}") from None


def _field(d: dict[str, Any], k: str, tp: type | tuple[type, ...]) -> Any:
    v = d.get(k)
    if not isinstance(v, tp) or (isinstance(v, bool) and tp in (int, float)):
        raise RemoteProtocolError(f"record field {k} has the wrong type")
    return v


def _planned(d: dict[str, Any]) -> tuple[NodeId, ...]:
    v = d.get("planned", [])  # absent from records of versions before it
    if not isinstance(v, list) or len(v) > 64 or not all(_is_id(x) for x in v):
        raise RemoteProtocolError("record field planned has the wrong type")
    return tuple(v)


def _name(d: dict[str, Any]) -> str:
    v = d.get("name", "")  # absent from records of versions before node names
    if not isinstance(v, str) or len(v) > MAX_NAME or not v.isprintable():
        raise RemoteProtocolError("record field name has the wrong type")
    return v


def _shares(d: dict[str, Any]) -> tuple[int, ...]:
    v = d.get("shares", [])  # absent from records of versions before multi-device nodes
    if not isinstance(v, list) or len(v) > 16 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise RemoteProtocolError("record field shares has the wrong type")
    return tuple(max(0, x) for x in v)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_WHY = 200


def _why(d: dict[str, Any]) -> str:
    v = d.get("why", "")
    if not isinstance(v, str) or len(v) > MAX_WHY or not v.isprintable():
        raise RemoteProtocolError("record field why has the wrong type")
    return v


def _layers(d: dict[str, Any], key: str = "lyr") -> tuple[tuple[int, int], ...]:
    v = d.get(key, [])  # absent from records of versions before it
    if not (isinstance(v, list) and len(v) <= 64
            and all(isinstance(x, list) and len(x) == 2 and all(_int(y) and 0 <= y < 2**16 for y in x) for x in v)):
        raise RemoteProtocolError(f"record field {key} has the wrong type")  # fmt: skip
    return tuple((x[0], x[1]) for x in v)


def _rate(d: dict[str, Any]) -> float:
    v = d.get("rate", 0.0)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e7 else 0.0


def _ram(d: dict[str, Any]) -> int:
    v = d.get("ram", 0)  # absent from records of versions that offered no RAM
    if not (_int(v) and 0 <= v < 2**62):
        raise RemoteProtocolError("record field ram has the wrong type")
    return int(v)


def _progress(d: dict[str, Any]) -> int:
    v = d.get("prog", -1)
    return max(-1, min(100, v)) if _int(v) else -1


def _pair(d: dict[str, Any], name: str) -> tuple[int, int]:
    v = d.get(name, [0, 0])  # absent from records of versions before mesh-wide counts
    if not (isinstance(v, list) and len(v) == 2 and all(_int(x) and 0 <= x < 2**63 for x in v)):
        raise RemoteProtocolError(f"record field {name} has the wrong type")
    return v[0], v[1]


def _slots(d: dict[str, Any]) -> tuple[int, int, int, int]:
    v = d.get("slots", [0, 0, 0, 0])  # absent from records of versions before slots
    if not (isinstance(v, list) and len(v) == 4 and all(_int(x) and 0 <= x < 2**32 for x in v)):
        raise RemoteProtocolError("record field slots has the wrong type")
    return v[0], v[1], v[2], v[3]


def _addrs(d: dict[str, Any], k: str, most: int) -> tuple[str, ...]:
    v = _field(d, k, list)[:most]
    if not all(tok.ip_port(a) for a in v):
        raise RemoteProtocolError(f"record field {k}: an address that is not an IP literal and a port")
    return tuple(v)


def _is_id(k: object) -> bool:
    return isinstance(k, bytes) and len(k) == 32


def open_record(raw: bytes) -> tuple[bytes, bytes, dict[str, Any]]:
    """Unpack a record's envelope and body (no checks beyond shape)."""
    if len(raw) > MAX_RECORD:
        raise RemoteProtocolError("record too large")
    outer = unpack(raw, MAX_RECORD)
    if not (
        isinstance(outer, list) and len(outer) == 2 and isinstance(outer[0], bytes) and isinstance(outer[1], bytes)
    ):
        raise RemoteProtocolError("record envelope malformed")
    body, sig = outer
    d = unpack(body, MAX_RECORD)
    if not isinstance(d, dict):
        raise RemoteProtocolError("record body is not a map")
    return body, sig, d


def record_version(opened: tuple[bytes, bytes, dict[str, Any]]) -> tuple[NodeId, int, int]:
    """(node, incarnation, seq) of an opened record, before any signature check: to skip what we have."""
    d = opened[2]
    return _field(d, "node", bytes), _field(d, "inc", int), _field(d, "seq", int)


def record_from_wire(
    raw: bytes, mesh_id: bytes, chains_ok: set[bytes] | None = None,
    opened: tuple[bytes, bytes, dict[str, Any]] | None = None,
) -> PeerRecord:  # fmt: skip
    """Decode, verify the signature and the admission chain. RemoteProtocolError otherwise. ``chains_ok``
    caches chains already verified (by their encoding: a chain changes only when renewed; the table checks when it
    ends); ``opened`` is the record already unpacked by :func:`open_record`."""
    body, sig, d = opened or open_record(raw)
    node = _field(d, "node", bytes)
    if not crypto.verify(node, crypto.D_RECORD, body, sig):
        raise RemoteProtocolError(f"record of {crypto.short(node)} has a bad signature")
    chain = adm.chain_from_wire(d.get("chain"))
    chain_key = pack([node, adm.chain_to_wire(chain)])
    if chains_ok is None or chain_key not in chains_ok:
        why = adm.verify_chain(chain, node, mesh_id)
        if why is not None:
            raise RemoteProtocolError(f"record of {crypto.short(node)} from a non-member: {why}")
        if chains_ok is not None and len(chains_ok) < 4 * MAX_RECORDS:
            chains_ok.add(chain_key)
    m = d.get("model")
    model = None
    if m is not None:
        if not isinstance(m, dict):
            raise RemoteProtocolError("record model malformed")
        if not is_fingerprint(m.get("fingerprint")):
            raise RemoteProtocolError("record model fingerprint is not 64 hex digits")
        model = ModelFacts(
            _field(m, "fingerprint", str), _field(m, "size", int), _field(m, "n_layer", int), _field(m, "source", str)
        )
    rtt = _field(d, "rtt", dict)
    host = d.get("host")
    if host is not None and not isinstance(host, bytes):
        raise RemoteProtocolError("record host malformed")
    return PeerRecord(
        node=node, incarnation=_field(d, "inc", int), seq=_field(d, "seq", int), role=_enum(d, "role", Role),
        addrs=_addrs(d, "addrs", 16), capacity=_field(d, "cap", int),
        device=_field(d, "dev", str), shares=_shares(d), name=_name(d), model=model, state=_enum(d, "state", NodeState),
        version=_field(d, "ver", str),
        rtt_ms={k: float(v) for k, v in list(rtt.items())[:64] if _is_id(k) and isinstance(v, int | float)},
        links={k: str(v)[:40] for k, v in list(_field(d, "links", dict).items())[:64] if _is_id(k)},
        relay=_field(d, "relay", bool), reflexive=_addrs(d, "nat", 4),
        host=host, planned=_planned(d), chain=tuple(chain), left=_field(d, "left", bool), at=_field(d, "at", int),
        served=_pair(d, "srv"), ttft=_pair(d, "ttft"), progress=_progress(d), why=_why(d), slots=_slots(d),
        layers=_layers(d), rate=_rate(d), held=_layers(d, "held") if "held" in d else None,
        replica=d.get("rep") is True, ram=_ram(d),
    )  # fmt: skip
