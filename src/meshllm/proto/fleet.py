"""The models a mesh serves, as every node sees them ([fleet]), pure: which nodes hold each model and which one
hosts it (each model has its own election: ``meshcore.host_of``). ``/v1/models``, ``/mesh/status``, ``mesh-llm
status`` and the console group the mesh by these."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshllm.proto.crypto import NodeId
from meshllm.proto.gossip import PeerRecord, Role
from meshllm.proto.planner import WAITING


@dataclass(frozen=True)
class ModelGroup:
    name: str  # the name the model is served under (its host's, else the first holder's)
    fingerprint: str
    host: PeerRecord | None  # its host as this node's election picks it (None: none yet)
    nodes: tuple[NodeId, ...]  # the live nodes that hold it (whole or a partial copy), its host first


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
        nodes = tuple(sorted((r.node for r in recs), key=lambda n: (host is None or n != host.node, n)))
        out.append(ModelGroup(first.model.source, fp, host, nodes))
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
