"""Who hosts a model: a pure function of the agreed table.

Candidates are the non-client nodes serving the same model (same fingerprint) whose admission chain gives them
the host scope (a worker-scoped member may claim any capacity: it is never elected). A node with an accelerator
beats one without (a CPU node offers its RAM, often the larger figure, but the host's device runs the output
and the plan keeps the per-token work on accelerators); then the highest capacity wins, ties to the highest NodeId.
A sitting host keeps the role unless a challenger of its kind beats its capacity by more than MARGIN (no flapping
when a node's figure wobbles), or an accelerator's node challenges a CPU host. Every node computes the same answer
from the same table; :class:`~meshllm.proto.debounce.Debouncer` makes a node act on a new answer only once it has
held for DEBOUNCE_S.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.proto.crypto import NodeId
from meshllm.proto.debounce import Debouncer
from meshllm.proto.record import Role
from meshllm.proto.token import Scope

__all__ = ["DEBOUNCE_S", "MARGIN", "Candidate", "Debouncer", "elect"]

MARGIN = 1.25
DEBOUNCE_S = 2.0


@dataclass(frozen=True)
class Candidate:
    node: NodeId
    capacity: int
    fingerprint: str | None
    role: Role = Role.WORKER
    scope: Scope = Scope.HOST
    gpu: bool = False  # its capacity is an accelerator's


def elect(candidates: list[Candidate], fingerprint: str, sitting: NodeId | None = None) -> NodeId | None:
    pool = [c for c in candidates if c.role != Role.CLIENT and c.scope >= Scope.HOST and c.fingerprint == fingerprint]
    if not pool:
        return None
    best = max(pool, key=lambda c: (c.gpu, c.capacity, c.node))
    if sitting is not None:
        cur = next((c for c in pool if c.node == sitting), None)
        if cur is not None and cur.gpu >= best.gpu and best.capacity <= cur.capacity * MARGIN:
            return cur.node
    return best.node
