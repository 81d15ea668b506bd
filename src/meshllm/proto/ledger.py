"""The members a node remembers across restarts: every member of its mesh it has seen alive (clients aside: nobody
dials a client), with the addresses it was last seen at and when — members that left cleanly included, since the
founder that stops first is the one the others most need to find again. Bounded (the most recently seen
MAX_MEMBERS) and aged (forgotten MAX_AGE_S after last seen).

A restarted node dials all of them, and a running node keeps dialling the ones it has no word of (neither connected
nor in its gossip table): two parts of one mesh that came up apart find each other, whatever the order of restarts.
A member that keeps failing is dialled less often (REDIAL_S, then SLOW_REDIAL_S after SLOW_AFTER failures).

Pure: wall times for "seen" (they outlive a restart), ``now`` (monotonic) for the dialling schedule."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

NodeId = bytes

MAX_MEMBERS = 64
MAX_AGE_S = 30 * 86400  # a member not seen for a month is forgotten (admissions hold 14 days unless renewed)
MAX_ADDRS = 8
REDIAL_S = 5.0
SLOW_REDIAL_S = 30.0
SLOW_AFTER = 24  # failed dials at REDIAL_S (two minutes) before a member is dialled every SLOW_REDIAL_S
RESAVE_S = 3600.0  # a member's "seen" is written again at most this often (the file is not rewritten every tick)


@dataclass(frozen=True)
class Known:
    addrs: tuple[str, ...]
    seen: float  # wall time it was last seen alive (or named by a token we joined with)


@dataclass
class Ledger:
    me: NodeId
    members: dict[NodeId, Known] = field(default_factory=dict)
    _fails: dict[NodeId, int] = field(default_factory=dict)
    _next: dict[NodeId, float] = field(default_factory=dict)  # monotonic time of the next dial, per member

    def ordered(self) -> list[tuple[NodeId, list[str]]]:
        """Every member and its addresses, the most recently seen first."""
        return [(n, list(k.addrs)) for n, k in sorted(self.members.items(), key=lambda x: -x[1].seen)]

    def see(self, node: NodeId, addrs: Iterable[str], wall: float) -> bool:
        """``node`` is alive (or named by a token) at ``addrs`` as of ``wall``. Whether the saved ledger is stale
        now: a new member, new addresses, or a "seen" more than RESAVE_S newer than the saved one."""
        if node == self.me:
            return False
        a = tuple(dict.fromkeys(addrs))[:MAX_ADDRS]
        if not a:
            return False
        old = self.members.get(node)
        self.members[node] = Known(a, max(wall, old.seen if old else wall))
        self._fails.pop(node, None)
        self._next.pop(node, None)
        stale = old is None or old.addrs != a or wall - old.seen >= RESAVE_S
        return self._bound(wall) or stale

    def _bound(self, wall: float) -> bool:
        """Forget members not seen for MAX_AGE_S, then all but the MAX_MEMBERS most recently seen; whether any went."""
        before = len(self.members)
        keep = sorted(((k.seen, n) for n, k in self.members.items() if wall - k.seen < MAX_AGE_S), reverse=True)
        kept = {n for _, n in keep[:MAX_MEMBERS]}
        for n in set(self.members) - kept:
            del self.members[n]
            self._fails.pop(n, None)
            self._next.pop(n, None)
        return len(self.members) != before

    def to_dial(self, present: set[NodeId], now: float) -> dict[NodeId, list[str]]:
        """The members to dial now: those we have no word of (not in ``present``: connected, or in the gossip table,
        which dials its own), each on its own schedule. Each returned counts as one more failure until seen."""
        out = {}
        for n, k in self.members.items():
            if n in present:
                self._fails.pop(n, None)
                self._next.pop(n, None)
                continue
            if now < self._next.get(n, now):
                continue
            fails = self._fails.get(n, 0) + 1
            self._fails[n] = fails
            self._next[n] = now + (REDIAL_S if fails < SLOW_AFTER else SLOW_REDIAL_S)
            out[n] = list(k.addrs)
        return out


def to_wire(led: Ledger) -> dict[str, object]:
    """The saved form: node id (hex) -> {"addrs": [...], "seen": wall seconds}."""
    return {n.hex(): {"addrs": list(k.addrs), "seen": round(k.seen)} for n, k in sorted(led.members.items())}


def from_wire(me: NodeId, data: object, wall: float) -> Ledger:
    """A ledger from its saved form; entries that do not parse are skipped (a damaged file loses only them). The
    first saved form (node id -> addresses) reads as seen now."""
    led = Ledger(me)
    if not isinstance(data, dict):
        return led
    for h, v in data.items():
        try:
            node = bytes.fromhex(h)
        except (TypeError, ValueError):
            continue
        if len(node) != 32:
            continue
        addrs, seen = (v, wall) if isinstance(v, list) else (v.get("addrs"), v.get("seen")) if isinstance(v, dict) \
            else (None, None)  # fmt: skip
        if not isinstance(addrs, list) or not isinstance(seen, (int, float)) or isinstance(seen, bool):
            continue
        a = tuple(dict.fromkeys(x for x in addrs if isinstance(x, str)))[:MAX_ADDRS]
        if a and node != me:
            led.members[node] = Known(a, min(float(seen), wall))
    led._bound(wall)
    return led
