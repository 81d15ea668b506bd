"""Who gets the host's llama-server slots next: a pure decision core (no I/O; time is given).

Every completion of the mesh runs in one of the host's llama-server slots (``--parallel N``). Requests come from the
host's own API clients and from every other node (through the host's door); the host admits at most N at once, so
llama-server never queues on its own, and decides here who goes next:

* **fair**: the next request is the one whose source (a node of the mesh, or one client address of the host's own
  API) runs the fewest slots now; ties go to the source served longest ago, then to the oldest request. One source's
  burst fills free slots but never keeps another source waiting behind all of it.
* **bounded**: at most ``queue_max`` wait. A request that finds the queue full displaces the newest waiting request
  of the source that has the most waiting (when that source has more waiting than the newcomer's would), so a burst
  cannot lock the others out either; otherwise the newcomer is refused — the API answers 429 with ``Retry-After``.
* a request for ``n`` completions (``n``, ``n_cmpl``) takes ``n`` slots, as llama-server runs them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

QUEUE_PER_SLOT = 4  # the default bound of the queue: this many waiting requests per slot (at least MIN_QUEUE)
MIN_QUEUE = 16
EWMA = 0.2  # how fast the estimate of a request's duration (for Retry-After) follows new ones
RETRY_MIN_S, RETRY_MAX_S = 1, 60
MAX_SOURCES = 4096  # sources whose last service is remembered (for round-robin); the oldest are forgotten


def default_queue(slots: int) -> int:
    return max(MIN_QUEUE, QUEUE_PER_SLOT * slots)


@dataclass(frozen=True)
class Ticket:
    id: int
    source: str
    weight: int  # slots it takes
    arrived: float


@dataclass(frozen=True)
class Admitted:
    ticket: Ticket


@dataclass(frozen=True)
class Queued:
    ticket: Ticket
    displaced: Ticket | None = None  # a waiting request pushed out to make room: the shell refuses it (429)


@dataclass(frozen=True)
class Refused:
    retry_after_s: int


@dataclass
class Slots:
    total: int
    queue_max: int
    running: dict[int, tuple[Ticket, float]] = field(default_factory=dict)  # id -> (ticket, admitted at)
    waiting: list[Ticket] = field(default_factory=list)  # in arrival order
    last_served: dict[str, float] = field(default_factory=dict)  # source -> when it was last admitted
    mean_s: float = 5.0  # estimated duration of one request (seconds)
    refused: int = 0  # refused or displaced so far
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def busy(self) -> int:
        return sum(t.weight for t, _ in self.running.values())

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def _running_of(self, source: str) -> int:
        return sum(t.weight for t, _ in self.running.values() if t.source == source)

    def _waiting_of(self, source: str) -> int:
        return sum(1 for t in self.waiting if t.source == source)

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead, served ``total`` at a time."""
        est = self.mean_s * (self.queued + 1) / max(1, self.total)
        return max(RETRY_MIN_S, min(RETRY_MAX_S, math.ceil(est)))

    def arrive(self, source: str, weight: int, now: float) -> Admitted | Queued | Refused:
        t = Ticket(next(self._ids), source, max(1, min(weight, self.total)), now)
        if not self.waiting and self.busy + t.weight <= self.total:
            self._admit(t, now)
            return Admitted(t)
        if len(self.waiting) < self.queue_max:
            self.waiting.append(t)
            return Queued(t)
        # full: push out the newest request of the source with the most waiting, if it has more than we would
        counts: dict[str, int] = {}
        for w in self.waiting:
            counts[w.source] = counts.get(w.source, 0) + 1
        top = max(counts, key=lambda s: (counts[s], s), default="")
        if top and counts[top] > self._waiting_of(source) + 1:
            victim = next(w for w in reversed(self.waiting) if w.source == top)
            self.waiting.remove(victim)
            self.waiting.append(t)
            self.refused += 1
            return Queued(t, displaced=victim)
        self.refused += 1
        return Refused(self.retry_after())

    def _admit(self, t: Ticket, now: float) -> None:
        self.running[t.id] = (t, now)
        self.last_served.pop(t.source, None)  # re-inserted last: the dict stays in order of service
        self.last_served[t.source] = now
        if len(self.last_served) > MAX_SOURCES:  # forget the source served longest ago (a client address of long ago)
            del self.last_served[next(iter(self.last_served))]

    def _rank(self, t: Ticket) -> tuple[int, float, int]:
        # fewest slots running for its source, then its source served longest ago, then the oldest (ids grow)
        return self._running_of(t.source), self.last_served.get(t.source, -math.inf), t.id

    def next_up(self, now: float) -> list[Ticket]:
        """Admit waiting requests while slots are free, fairest first; the ones admitted."""
        out: list[Ticket] = []
        while self.waiting:
            best = min(self.waiting, key=self._rank)
            if self.busy + best.weight > self.total:
                break  # it waits for room (a smaller request does not jump it: no starvation of n > 1)
            self.waiting.remove(best)
            self._admit(best, now)
            out.append(best)
        return out

    def leave(self, ticket_id: int, now: float) -> list[Ticket]:
        """A request ended (answered, failed, or its client went away) or gave up waiting: its slots free up. The
        waiting requests admitted in its place."""
        ran = self.running.pop(ticket_id, None)
        if ran is not None:
            _, since = ran
            self.mean_s += EWMA * (max(0.0, now - since) - self.mean_s)
        else:
            self.waiting = [w for w in self.waiting if w.id != ticket_id]
        return self.next_up(now)

    def resize(self, total: int, queue_max: int, now: float) -> list[Ticket]:
        """A new llama-server with ``total`` slots: the ones admitted at once."""
        self.total, self.queue_max = max(1, total), max(0, queue_max)
        return self.next_up(now)
