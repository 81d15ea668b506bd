"""What the mesh tells the node that runs it, as values on one queue (``MeshNet.events``): the node's single loop
takes them in order and applies them. Nothing in ``net/`` calls back into the node."""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.proto.crypto import NodeId
from meshllm.proto.meshcore import EventKind


@dataclass(frozen=True)
class Changed:
    """The mesh's view may have changed (a record, a connection, our own record, the half-second tick): reconsider
    the host, the plan and what runs. At most one is queued at a time."""


@dataclass(frozen=True)
class MeshEvent:
    """Something the mesh core saw happen to a member: joined, left, died, elected host, refuted."""

    kind: EventKind
    node: NodeId
    detail: str = ""


@dataclass(frozen=True)
class Connected:
    """A connection to a member is up (or moved), on ``path``."""

    node: NodeId
    path: str


@dataclass(frozen=True)
class AddrsLearned:
    """Members told us the addresses they see us at."""

    addrs: tuple[str, ...]


NetEvent = Changed | MeshEvent | Connected | AddrsLearned
CHANGED = Changed()
