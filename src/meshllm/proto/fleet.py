"""The models a mesh serves, as every node sees them, pure: which nodes hold each model and which one
hosts it (each model has its own election: ``meshcore.host_of``). ``/v1/models``, ``/mesh/status``, ``mesh-llm
status`` and the console group the mesh by these."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import WAITING
from meshllm.proto.record import PeerRecord, Role
from meshllm.proto.token import Scope

AVOID_S = 15.0  # a host whose request just failed gets none while another serves, for this long (or until it is back)


@dataclass(frozen=True)
class ModelGroup:
    name: str  # the name the model is served under (its host's, else the first holder's)
    fingerprint: str
    host: PeerRecord | None  # its host as this node's election picks it (None: none yet)
    nodes: tuple[NodeId, ...]  # the live nodes that hold it (whole or a partial copy), its host first, then replicas
    replicas: tuple[NodeId, ...] = ()  # hosts of it beside its elected one (``replica_wanted``), by id


def model_groups(records: Iterable[PeerRecord], host_of: Callable[[PeerRecord], PeerRecord | None]
                 ) -> list[ModelGroup]:  # fmt: skip
    """One group per model the live ``records`` hold (lite clients hold none), by name; ``host_of``: a record's
    model's host."""
    by_fp: dict[str, list[PeerRecord]] = {}
    for r in records:
        if r.model is not None and r.role != Role.CLIENT:
            by_fp.setdefault(r.model.fingerprint, []).append(r)
    out = []
    for fp, recs in by_fp.items():
        recs.sort(key=lambda r: r.node)
        host = host_of(recs[0])
        host = host if host is not None and host.model is not None and host.model.fingerprint == fp else None
        first = host or recs[0]
        assert first.model is not None
        used = set(host.planned) if host is not None else set()
        reps = tuple(r.node for r in recs if r.replica and r.role == Role.HOST and r.whole and r.scope >= Scope.HOST
                     and r.node not in used and (host is None or r.node != host.node))  # fmt: skip
        nodes = tuple(sorted((r.node for r in recs), key=lambda n: (host is None or n != host.node, n not in reps, n)))
        out.append(ModelGroup(first.model.source, fp, host, nodes, reps))
    return sorted(out, key=lambda g: (g.name, g.fingerprint))


def neediest(groups: Iterable[ModelGroup]) -> ModelGroup | None:
    """The model a node that joins without one should serve (``--model auto``): one whose host waits for memory
    first, then the busiest (requests waiting for a slot, then slots busy), then by name. Only models with a host
    (a model nobody may host takes no worker)."""
    def need(g: ModelGroup) -> tuple[bool, int, int, str]:
        assert g.host is not None
        busy, _, queued, _ = g.host.slots
        return (not g.host.why.startswith(WAITING), -queued, -busy, g.name)

    hosted = [g for g in groups if g.host is not None]
    return min(hosted, key=need) if hosted else None


def move_to(me: PeerRecord, groups: Sequence[ModelGroup]) -> ModelGroup | None:
    """Where a node started with ``--model auto`` goes while its own model's elected host runs a plan without it (it
    serves a replica, or stands by): to a model whose host waits for memory (the neediest of those). None: it
    stays — its model's plan uses it, or waits for memory itself (so a node never bounces between waiting models)."""
    mine = next((g for g in groups if me.model is not None and g.fingerprint == me.model.fingerprint), None)
    if mine is None or mine.host is None or not mine.host.planned or me.node in mine.host.planned:
        return None
    return neediest(g for g in groups if g is not mine and g.host is not None and g.host.why.startswith(WAITING))


def asked_for(words: Iterable[tuple[str, bool, int]], served: Container[str]) -> str | None:
    """The model a node that serves nothing (``--model auto``) takes up by the founder's or an admin's word: of the
    models they asked the mesh to serve (``mesh-llm serve NAME``: (name, serve, when)) and no node serves, the one
    asked for first (None: none)."""
    waiting = sorted((at, name) for name, serve, at in words if serve and name not in served)
    return waiting[0][1] if waiting else None


# ------------------------------------------------------------------------------------------------ replicas


def replica_wanted(me: PeerRecord, host: PeerRecord | None, fits_alone: bool) -> bool:
    """Whether ``me`` serves a replica of its model beside ``host`` (the elected host of that model, as our election
    picks it): it holds the whole model and may host, its memory holds the model alone (``fits_alone``), and the host
    runs a plan that does not use it. A host whose plan waits for memory names no nodes: then every node stays
    available to it (a replica never takes memory the model itself still needs)."""
    return (host is not None and me.whole and me.role != Role.CLIENT
            and me.scope >= Scope.HOST and host.role == Role.HOST and bool(host.planned)
            and me.node not in host.planned and me.model is not None and host.model is not None
            and me.model.fingerprint == host.model.fingerprint and fits_alone)  # fmt: skip


def left_out(host: PeerRecord | None, records: Iterable[PeerRecord], fits_alone: Callable[[PeerRecord], bool]
             ) -> list[PeerRecord]:  # fmt: skip
    """The nodes that may form a second split of ``host``'s model: holding the whole file, worker- or host-scoped,
    not lite, not in the plan ``host`` (its elected host) runs, and not holding it alone (those serve whole
    replicas: ``replica_wanted``). Empty while the host runs no plan naming nodes (one that waits for memory keeps
    every node available to it)."""
    if host is None or host.model is None or host.role != Role.HOST or not host.planned:
        return []
    fp = host.model.fingerprint
    return sorted((r for r in records if r.model is not None and r.model.fingerprint == fp and r.whole
                   and r.role != Role.CLIENT and r.scope >= Scope.WORKER and r.node != host.node
                   and r.node not in host.planned and not fits_alone(r)), key=lambda r: r.node)  # fmt: skip


def replica_nodes(records: Iterable[PeerRecord], host: NodeId | None) -> frozenset[NodeId]:
    """The nodes that serve a replica beside ``host`` (the elected one): replica hosts and the nodes their plans
    use. The elected host's plan takes them last (``planner.plan``'s ``busy``): taking one ends the replica, and the
    answers it streams must move again."""
    reps = [r for r in records if r.replica and r.role == Role.HOST and r.node != host]
    return frozenset(n for r in reps for n in (r.node, *r.planned))


def split_replica_host(left: Sequence[PeerRecord]) -> PeerRecord | None:
    """Of the ``left_out`` nodes, the one that hosts their split (a replica that is a split): the host-scoped one with
    the most memory (then the lowest id) — every node picks the same one from the same records."""
    hosts = [r for r in left if r.scope >= Scope.HOST]
    return max(hosts, key=lambda r: (r.capacity, -int.from_bytes(r.node, "big"))) if hosts else None


@dataclass
class Spread:
    """Where this node sends each request among the hosts of a model (its elected host and its replicas): the one
    with the least load per slot, by what gossip says it runs and queues and what this node has sent it and not
    yet seen answered (gossip lags a second: 16 requests at once would otherwise all go to one host). A host whose
    request failed lately gets none while another serves (``AVOID_S``)."""

    in_flight: Counter[NodeId] = field(default_factory=Counter)
    failed: dict[NodeId, float] = field(default_factory=dict)

    def begin(self, node: NodeId) -> None:
        self.in_flight[node] += 1

    def end(self, node: NodeId) -> None:
        self.in_flight[node] -= 1
        if self.in_flight[node] <= 0:
            del self.in_flight[node]

    def fail(self, node: NodeId, now: float) -> None:
        self.failed[node] = now

    def pick(self, hosts: Sequence[PeerRecord], now: float) -> PeerRecord | None:
        """One of ``hosts`` (records of hosts that serve; ours among them when our own llama-server does)."""
        for n, t in list(self.failed.items()):
            if now - t > AVOID_S:
                del self.failed[n]
        fine = [h for h in hosts if h.node not in self.failed] or list(hosts)

        def load(h: PeerRecord) -> tuple[float, int, NodeId]:
            busy, total, queued, _ = h.slots
            mine = self.in_flight[h.node]
            return max(busy + queued, mine) / max(1, total), mine, h.node

        return min(fine, key=load) if fine else None
