"""Where each node and the mesh stand, in one vocabulary, computed here from the gossip records every node holds:
so the host, a worker and a lite client say the same thing about the same node, in ``status``, the console, 503s
and ``/health``. Before, a lite client called a serving worker "standby", a worker called a dead host
"loading" while a lite client said "no host elected yet".

The states, for people (the README's "What the states mean" says the same):

- serving: the host answers requests; a worker whose layers are in the plan the host runs while it serves.
- loading: the host's llama-server is starting (or restarting after a crash); the workers of its plan.
- waiting for peers: no plan fits the mesh's memory yet, or no host is elected: more machines must join.
- standby: a node with the model that the host's plan does not use (kept for a later plan).
- unreachable: not heard from for a few seconds (declared gone after ``DEAD_AFTER_S``, then no longer listed).
- failed: the host's llama-server crashed again and again and it gave up (the reason names the likely cause).

A lite client has no state of its own: its API answers as the mesh does, so it shows the host's.

Also here, pure: :class:`Tally`, which keeps counts that several nodes report (each from zero again when it
restarts) as one figure that never goes down, so a mesh-wide number does not lose its history when a host dies.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from enum import StrEnum

from meshllm.proto import crypto
from meshllm.proto.gossip import SUSPECT_AFTER_S
from meshllm.proto.record import NodeState, PeerRecord, Role


class State(StrEnum):
    SERVING = "serving"
    LOADING = "loading"
    WAITING = "waiting for peers"
    STANDBY = "standby"
    UNREACHABLE = "unreachable"
    FAILED = "failed"


FAILED_PREFIX = "failed: "  # a host's ``why`` that starts so: its llama-server crashed again and again, and it gave up
@dataclass(frozen=True)
class Standing:
    state: State
    why: str = ""  # the reason, for people ("loading the model: 43%", "need 0.6 GB, have 0.3 GB", ...)

    def text(self) -> str:
        """One line: the state and its reason (a reason that already says the state is not repeated)."""
        if not self.why:
            return str(self.state)
        said = self.why.split(" ", 1)[0] == str(self.state).split(" ", 1)[0]  # "waiting for more peers — ..."
        return self.why if said else f"{self.state}: {self.why}"


NO_HOST = Standing(State.WAITING, "no host elected yet")


def label(role: Role | str, replica: bool, elected: bool, state: State) -> str:
    """The one word a node goes by in ``/mesh/status``, the console and ``mesh-llm status``: client,
    host (the elected one: also while it takes over, its record still saying worker), replica (a host of the model
    beside the elected one), standby (its model's plan does not use it), worker. Before, the console's label came
    from the record's role and the state line from the election, and an elected node read "worker" beside "elected:
    taking over as the host"."""
    if role == Role.CLIENT:
        return "client"
    if role == Role.HOST and replica:
        return "replica"
    if role == Role.HOST or elected:
        return "host"
    return "standby" if state == State.STANDBY else "worker"


def of_host(rec: PeerRecord, silent_s: float) -> Standing:
    """The host's own standing, from its record and how long since we last heard from it."""
    if silent_s >= SUSPECT_AFTER_S:
        return Standing(State.UNREACHABLE, f"not heard from for {silent_s:.0f} s")
    if rec.role != Role.HOST:
        return Standing(State.LOADING, "elected: taking over as the host")
    if rec.state == NodeState.SERVING:
        return Standing(State.SERVING)
    if rec.state == NodeState.LOADING:  # its llama-server is (re)starting: a crash says so in ``why``
        if rec.why.startswith(FAILED_PREFIX):
            return Standing(State.FAILED, rec.why.removeprefix(FAILED_PREFIX))
        if rec.why:
            return Standing(State.LOADING, rec.why)
        return Standing(State.LOADING, f"loading the model: {rec.progress}%" if rec.progress >= 0 else "")
    if rec.why:  # it runs no llama-server, and says why (a plan waiting for memory)
        return Standing(State.WAITING, rec.why)
    return Standing(State.LOADING, "planning")


def of_node(rec: PeerRecord, silent_s: float, host: PeerRecord | None, host_silent_s: float) -> Standing:
    """Any node's standing: ``host`` is the record of the host of its model as our election picks it (None: none),
    ``silent_s`` / ``host_silent_s`` how long since we last heard from each (0 for ourselves)."""
    if silent_s >= SUSPECT_AFTER_S:
        return Standing(State.UNREACHABLE, f"not heard from for {silent_s:.0f} s")
    if rec.role == Role.HOST or (host is not None and host.node == rec.node):
        return of_host(rec, silent_s)
    if host is None:
        return NO_HOST
    h = of_host(host, host_silent_s)
    if rec.role == Role.CLIENT:
        return h
    who = f"its host {crypto.short(host.node)}"
    if h.state == State.UNREACHABLE:
        return Standing(State.WAITING, f"{who} is unreachable")
    if h.state in (State.WAITING, State.FAILED):
        return h
    if rec.node in host.planned:
        return Standing(h.state, h.why if h.state == State.LOADING else "")
    return Standing(State.STANDBY, f"not in {who}'s plan")


def of_mesh(host: PeerRecord | None, host_silent_s: float) -> Standing:
    """What the mesh can do for a request, from its host's record: what every node's ``/health`` and 503s say."""
    return of_host(host, host_silent_s) if host is not None else NO_HOST


def host_says(host: PeerRecord | None, host_silent_s: float) -> str:
    """Why the host cannot serve, as one line every node gives ("" when it serves, or there is none)."""
    if host is None:
        return ""
    s = of_host(host, host_silent_s)
    return "" if s.state == State.SERVING else f"the host {crypto.short(host.node)} is {s.text()}"


# ------------------------------------------------------------------------------------------------ tallies

MAX_SOURCES = 1024  # sources a tally remembers one by one; beyond, the oldest is folded into the base


class Tally:
    """Counts that several sources report (a host's tokens, each node's requests), each a tuple of counters from
    zero at its start, summed into one figure that never goes down: a source's last counts stay in the sum when it
    dies, and a source whose counts go down started again (a restart) and is added on top of what it had."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._base = (0,) * width
        self._last: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()

    def see(self, source: Hashable, counts: tuple[int, ...]) -> None:
        old = self._last.pop(source, None)
        if old is not None and any(c < o for c, o in zip(counts, old, strict=True)):
            self._base = tuple(b + o for b, o in zip(self._base, old, strict=True))  # it counts from zero again
        self._last[source] = counts
        while len(self._last) > MAX_SOURCES:
            _, gone = self._last.popitem(last=False)
            self._base = tuple(b + g for b, g in zip(self._base, gone, strict=True))

    def total(self) -> tuple[int, ...]:
        out = self._base
        for counts in self._last.values():
            out = tuple(a + b for a, b in zip(out, counts, strict=True))
        return out


class RateMeter:
    """A counter's rate over the last ``window_s`` seconds (tokens per second now, not per request's end)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, int]] = deque()

    def add(self, now: float, count: int) -> float:
        """Record ``count`` at ``now``; the rate over the window since (0 until a second has passed)."""
        self._seen.append((now, count))
        while len(self._seen) > 2 and now - self._seen[1][0] >= self.window_s:
            self._seen.popleft()
        t0, c0 = self._seen[0]
        return max(0.0, (count - c0) / (now - t0)) if now - t0 >= 1.0 else 0.0
