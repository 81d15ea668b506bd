"""Reaching peers behind NATs, without I/O: control-packet layouts, the hole-punch schedule and the relay rule.

Control packets share the node's UDP socket with QUIC; their first byte has bit 0x40 clear (every QUIC v1 packet
sets it). Layouts (node ids are the 32-byte Ed25519 public keys)::

    PROBE      0x01 | from node (32) | nonce (8) | sig (64)   hole punching: "I am trying to reach you"
    PROBE_ACK  0x02 | from node (32) | nonce (8) | sig (64)   the answer, sent to where the probe came from
    RELAY      0x10 | to node (32)   | pair token (8) | QUIC datagram      to a relay: please pass this on
    RELAYED    0x11 | from node (32) | pair token (8) | QUIC datagram      from a relay: this came from that member

A relay fills in RELAYED's sender from its own authenticated connection on which the RELAY packet's source
address sits, never from the packet, and forwards only from and to members it has authenticated connections with,
so it is never an open reflector; the payload is a QUIC packet encrypted end to end, and it holds no keys for it.
The pair token is that connection's own (``auth.pair_token``: from the challenge nonce, which travelled inside
it): a third party that spoofs a member's source address, not knowing it, has its packets dropped, both ways.

Hole punching (facts measured on Linux NATs, see DESIGN.md): a packet that reaches the other side's NAT before
that side has sent anything creates a conntrack entry that makes the other NAT remap its port for good. So each
side first sends probes with TTL 2 (they open our own NAT's mapping and die at the first router beyond it), and
only after ``LOW_TTL_S`` sends probes that go all the way. The dialling side (the smaller node id, or a client)
dials QUIC to the address a probe or ack arrived from. An ack proves a path both ways: that is when a relayed
connection moves onto the punched path (its QUIC connection carries on; only where its datagrams go changes).

Probes and acks are signed by their sender's node key over (kind, nonce, the node they are for): the rendezvous
knows the nonce, so without the signature a member in that role could forge an ack from an address of its own and
move a relayed connection's datagrams there. A probe is checked only once its nonce matches an attempt in progress
(random packets cost no signature check).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from enum import StrEnum

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.wire import Message, message

PROBE = 0x01
PROBE_ACK = 0x02
RELAY = 0x10
RELAYED = 0x11
ID_LEN = 32
NONCE_LEN = 8

LOW_TTL = 2
LOW_TTL_S = 1.0  # long enough for the punch request to reach the other side through the rendezvous
PROBE_EVERY_S = 0.1
PUNCH_S = 5.0  # an attempt probes this long (a relayed connection moves onto the path if probes cross meanwhile)
PUNCH_WAIT_S = 2.0  # a dial waits this long for a probe back (one that works has one in ~1 s), then takes a relay

Addr = tuple[str, int]


class RelayMode(StrEnum):
    """Whether this node relays datagrams between members: AUTO when it finds itself publicly reachable
    (the default), ON always (--relay-server), OFF never (--no-relay-server)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


# ------------------------------------------------------------------ control packets


SIG_LEN = 64
D_PROBE = b"mesh-llm probe v1\0"


def probe(kind: int, key: Ed25519PrivateKey, to: NodeId, nonce: bytes) -> bytes:
    """A probe or ack from ``key``'s node to ``to``, signed."""
    assert kind in (PROBE, PROBE_ACK) and len(to) == ID_LEN and len(nonce) == NONCE_LEN
    return bytes([kind]) + crypto.node_id(key) + nonce + crypto.sign(key, D_PROBE, bytes([kind]) + nonce + to)


def parse_probe(data: bytes) -> tuple[int, NodeId, bytes] | None:
    """(kind, sender, nonce) of a well-formed probe or ack; its signature is checked by ``probe_is_from``."""
    if len(data) != 1 + ID_LEN + NONCE_LEN + SIG_LEN or data[0] not in (PROBE, PROBE_ACK):
        return None
    return data[0], data[1 : 1 + ID_LEN], data[1 + ID_LEN : 1 + ID_LEN + NONCE_LEN]


def probe_is_from(data: bytes, to: NodeId) -> bool:
    """Whether a well-formed probe was signed by the node it names, for ``to``."""
    kind, sender, nonce = data[0], data[1 : 1 + ID_LEN], data[1 + ID_LEN : 1 + ID_LEN + NONCE_LEN]
    return crypto.verify(sender, D_PROBE, bytes([kind]) + nonce + to, data[1 + ID_LEN + NONCE_LEN :])


TOKEN_LEN = 8


def relay_packet(kind: int, node: NodeId, token: bytes, payload: bytes) -> bytes:
    assert kind in (RELAY, RELAYED) and len(node) == ID_LEN and len(token) == TOKEN_LEN
    return bytes([kind]) + node + token + payload


def parse_relay(data: bytes) -> tuple[int, NodeId, bytes, bytes] | None:
    """(kind, node, pair token, payload) of a RELAY/RELAYED packet whose payload is a QUIC packet, else None."""
    head = 1 + ID_LEN + TOKEN_LEN
    if len(data) <= head or data[0] not in (RELAY, RELAYED) or not data[head] & 0x40:
        return None
    return data[0], data[1 : 1 + ID_LEN], data[1 + ID_LEN : head], data[head:]


Member = tuple[NodeId, bytes]  # a member we hold an authenticated connection with, and that connection's pair token
Place = tuple[Addr, bytes]  # where that member is, and the token


def relay_forward(
    data: bytes, src: Addr, member_at: dict[Addr, Member], addr_of: dict[NodeId, Place]
) -> tuple[bytes, Addr] | None:
    """What a relay sends for a RELAY packet from ``src``: (RELAYED packet, destination), or None to drop it.
    ``member_at``/``addr_of`` describe the relay's authenticated connections to members only; the packet must
    carry the pair token of the sender's."""
    p = parse_relay(data)
    if p is None or p[0] != RELAY:
        return None
    sender, dst = member_at.get(src), addr_of.get(p[1])
    if sender is None or dst is None or p[1] == sender[0] or not hmac.compare_digest(p[2], sender[1]):
        return None
    return relay_packet(RELAYED, sender[0], dst[1], p[3]), dst[0]


RELAY_RATE = 8 * 1024 * 1024  # what a relay forwards per pair of members by default, bytes/s (--relay-rate, in MB/s)
PAIR_IDLE_S = 30.0  # a pair quiet this long is forgotten (its bucket would be full again anyway)


@dataclass
class PairBudget:
    """What a relay forwards for each pair of members (sender, destination), pure: a token bucket of ``rate``
    bytes/s holding a quarter second's worth, so one pair's bulk transfer cannot take the relay's whole uplink from
    the others; a packet over it is dropped (QUIC's congestion control slows that pair down). ``rate`` 0: no cap."""

    rate: float = RELAY_RATE
    _pairs: dict[tuple[Addr, Addr], tuple[float, float]] = field(default_factory=dict)  # bytes left, as of when

    @property
    def burst(self) -> float:
        return max(self.rate / 4, 64 * 1024)

    def take(self, pair: tuple[Addr, Addr], n: int, now: float) -> bool:
        """Whether a packet of ``n`` bytes for ``pair`` goes out now (it is then counted)."""
        if self.rate <= 0:
            return True
        left, at = self._pairs.get(pair, (self.burst, now))
        left = min(self.burst, left + (now - at) * self.rate)
        ok = left >= n
        self._pairs[pair] = (left - n if ok else left, now)
        if len(self._pairs) > 64:  # forget quiet pairs
            self._pairs = {k: v for k, v in self._pairs.items() if now - v[1] < PAIR_IDLE_S}
        return ok

    def pairs(self, now: float) -> int:
        """Pairs forwarded for lately."""
        return sum(1 for _, at in self._pairs.values() if now - at < PAIR_IDLE_S)


@dataclass(frozen=True)
class RelayCandidate:
    node: NodeId
    relays: bool  # its record says it relays
    addrs: tuple[str, ...]
    reaches_target: bool  # its record says it is connected to the node we want
    rtt_ms: float | None


def order_relays(cands: list[RelayCandidate], hint: str | None) -> list[NodeId]:
    """Which members to try as relays, best first: the one ``--relay HOST:PORT`` names (even if it does not
    advertise relaying: the user says it will), then relaying members connected to the target, by RTT."""

    def named(c: RelayCandidate) -> bool:
        return hint is not None and hint in c.addrs

    def key(c: RelayCandidate) -> tuple[bool, bool, float, bytes]:
        return (not named(c), not c.reaches_target, c.rtt_ms if c.rtt_ms is not None else 1e9, c.node)

    return [c.node for c in sorted((c for c in cands if c.relays or named(c)), key=key)]


# ------------------------------------------------------------------ virtual addresses of relayed paths


def relayed_addr(relay: NodeId, peer: NodeId) -> Addr:
    """The address a relayed QUIC connection to ``peer`` through ``relay`` goes by inside this node."""
    return (f"relay:{relay.hex()}:{peer.hex()}", 0)


def parse_relayed_addr(addr: Addr) -> tuple[NodeId, NodeId] | None:
    if addr[1] != 0 or not addr[0].startswith("relay:"):  # every datagram sent asks: answer the common case fast
        return None
    parts = addr[0].split(":")
    if len(parts) != 3:
        return None
    try:
        return bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        return None


# ------------------------------------------------------------------ our own addresses


def observe(reflexive: list[str], own: list[str], seen: str, local: set[str], port: int) -> tuple[list[str], bool]:
    """A member saw our packets come from ``seen``: (our reflexive addresses now, newest last; whether ``seen`` is
    one of our own addresses, i.e. that member reaches us without a NAT in between). An IPv6 address says neither:
    it is not translated, and most home routers drop unsolicited IPv6 from outside, so seeing our own address there
    does not make us a relay (a member uses a relay only where it holds a direct connection to it anyway)."""
    host, _, p = seen.rpartition(":")
    if host.startswith("["):
        return reflexive, False
    public = host in local and p == str(port)
    if public or seen in own or seen in reflexive:
        return reflexive, public
    return [*reflexive, seen][-2:], False


def advertised(reflexive: list[str], own: list[str], limit: int) -> list[str]:
    """Our addresses for gossip and tokens: the ones members saw first (they are what others can reach)."""
    return [*reflexive[::-1], *(a for a in own if a not in reflexive)][:limit]


def direct_targets(addrs: list[str], nat: set[str], can_punch: bool) -> list[str] | None:
    """Which of a member's addresses to dial straight away (None: none, punch first). A NATed peer's public
    address gets no full-TTL packet before the punch: arriving before the peer has sent anything, it would make
    the peer's NAT remap its port for good. Its private addresses are among the punch's targets anyway (a peer on
    our LAN answers those probes). With nobody to coordinate a punch, dial everything."""
    if not can_punch:
        return addrs
    return None if nat else addrs


# ------------------------------------------------------------------ gossip-stream messages


@message
@dataclass(frozen=True)
class Observed(Message):
    """Sent once on every new connection: the address this connection's packets arrive from (the peer's reflexive
    address when it sits behind a NAT)."""

    TYPE = "reach.observed"
    addr: str


@message
@dataclass(frozen=True)
class PunchRequest(Message):
    """``src`` asks ``dst`` (through a member both are connected to) to send probes to ``addrs`` now. The
    rendezvous overwrites ``src`` with the authenticated sender and adds the address it sees the sender at."""

    TYPE = "reach.punch"
    src: bytes
    dst: bytes
    nonce: bytes
    addrs: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ the punch schedule


@dataclass
class Attempt:
    peer: NodeId
    nonce: bytes
    targets: list[Addr]
    started: float
    dialler: bool
    next_probe: float = 0.0
    found: Addr | None = None  # where the peer's probe or ack came from
    quiet: bool = False  # our path is proven: stop probing, keep answering until the attempt ends (the peer may
    # still be waiting for an ack of its own)
    _signed: dict[int, bytes] = field(default_factory=dict)

    def signed(self, kind: int, key: Ed25519PrivateKey) -> bytes:
        """Our probe or ack for this attempt (Ed25519 signatures are deterministic: signed once, sent many times)."""
        if kind not in self._signed:
            self._signed[kind] = probe(kind, key, self.peer, self.nonce)
        return self._signed[kind]


@dataclass
class Send:
    data: bytes
    addr: Addr
    ttl: int | None  # None: the socket's default


@dataclass
class Heard:
    """What a probe or ack means: answers to send; where the dialler may dial now; a path proven both ways."""

    peer: NodeId | None = None
    sends: list[Send] = field(default_factory=list)
    dial: Addr | None = None
    confirmed: Addr | None = None


@dataclass
class Puncher:
    """Every attempt in progress. The shell calls ``tick`` every PROBE_EVERY_S and sends what it returns."""

    key: Ed25519PrivateKey  # signs our probes and acks
    attempts: dict[NodeId, Attempt] = field(default_factory=dict)
    me: NodeId = field(init=False)  # our node id, from the key (checked against every probe's recipient)

    def __post_init__(self) -> None:
        self.me = crypto.node_id(self.key)

    def start(
        self, peer: NodeId, targets: list[Addr], now: float, dialler: bool, nonce: bytes | None = None
    ) -> Attempt:
        old = self.attempts.get(peer)
        if old is not None and old.nonce == nonce:
            old.targets = _merge(old.targets, targets)  # the same attempt heard of twice
            return old
        a = Attempt(peer, nonce or os.urandom(NONCE_LEN), _merge([], targets), now, dialler, next_probe=now)
        self.attempts[peer] = a
        return a

    def tick(self, now: float) -> list[Send]:
        out: list[Send] = []
        for peer, a in list(self.attempts.items()):
            if now - a.started > PUNCH_S:
                del self.attempts[peer]
                continue
            if now < a.next_probe or a.quiet:
                continue
            a.next_probe = now + PROBE_EVERY_S
            ttl = LOW_TTL if now - a.started < LOW_TTL_S else None
            out += [Send(a.signed(PROBE, self.key), t, ttl) for t in a.targets]
        return out

    def on_probe(self, data: bytes, src: Addr, now: float) -> Heard:
        """A control packet that may be a probe or an ack of ours."""
        p = parse_probe(data)
        if p is None:
            return Heard()
        kind, peer, nonce = p
        a = self.attempts.get(peer)
        if a is None or a.nonce != nonce or not probe_is_from(data, self.me):
            return Heard()
        a.found = src
        if kind == PROBE:
            return Heard(peer, [Send(a.signed(PROBE_ACK, self.key), src, None)], src if a.dialler else None)
        # an ack: our probe reached the peer and its answer reached us, so ``src`` works both ways
        return Heard(peer, [], src if a.dialler else None, confirmed=src)

    def done(self, peer: NodeId) -> None:
        self.attempts.pop(peer, None)

    def quiet(self, peer: NodeId) -> None:
        a = self.attempts.get(peer)
        if a is not None:
            a.quiet = True


def _merge(old: list[Addr], new: list[Addr]) -> list[Addr]:
    out = list(old)
    for a in new:
        if a not in out:
            out.append(a)
    return out[:8]


def punch_targets(claimed: list[str], advertised: tuple[str, ...]) -> list[str]:
    """Where we probe for a punch request: its first address (what the rendezvous saw the asker at) and those of
    the rest that the asker's own signed record advertises. Any member can send a punch request naming anyone: so
    it can point our probes at one address of its choice, not at eight."""
    return [a for i, a in enumerate(claimed[:8]) if i == 0 or a in advertised]


def rendezvous(sender: NodeId, sender_seen: list[str], target_seen: list[str], req: PunchRequest) -> list[PunchRequest]:
    """What a member passes on for a punch request from ``sender`` (authenticated): to the target, the request
    vouched for (sender from the connection, not the message) with the address we see the sender at first; back
    to the sender, the address we see the target at (its public address may not have reached the sender's table
    yet: it is in the target's record only once a member has told the target). Nothing for a malformed request."""
    if req.dst == sender or len(req.nonce) != NONCE_LEN:
        return []
    fwd = PunchRequest(src=sender, dst=req.dst, nonce=req.nonce, addrs=[*sender_seen, *req.addrs][:8])
    back = PunchRequest(src=req.dst, dst=sender, nonce=req.nonce, addrs=target_seen[:8])
    return [fwd, back]
