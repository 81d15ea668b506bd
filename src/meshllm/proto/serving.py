"""Serving decisions, pure: where a request for a model goes, which llama-server this node should run, who may open
an RPC stream to this worker's rpc-server, which of two connections for one pair of nodes survives, and whether the
host reaches a worker's rpc-server directly or through a tunnel.

Each is a function of plain data; the asyncio shells in ``serve/`` and ``net/`` gather that data and carry the
decision out. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgpack

from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import Plan, Waiting
from meshllm.proto.spill import experts_override

# ------------------------------------------------------------------------------------------------ routing


@dataclass(frozen=True)
class Local:
    """Our own llama-server serves it."""

    model: str


@dataclass(frozen=True)
class Remote:
    """The host ``host`` serves it; the request goes through our tunnel listener to it."""

    host: NodeId
    model: str


@dataclass(frozen=True)
class Connecting:
    """The host ``host`` serves it, but our tunnel listener to it is not up yet: open one, answer 503 meanwhile."""

    host: NodeId
    retry_after_s: int = 1


@dataclass(frozen=True)
class Busy:
    """Nobody can serve it right now (503 with Retry-After)."""

    reason: str
    retry_after_s: int = 5


Route = Local | Remote | Connecting | Busy | None  # None: no node of the mesh serves a model of that name


@dataclass(frozen=True)
class LocalServing:
    """What this node's own llama-server is doing (None in :func:`route` when it runs none)."""

    model: str  # the name it serves the model under
    state: str  # loading | serving | failed | stopped
    reason: str = ""


def default_model(served: list[str], own: str | None) -> str | None:
    """The model a request that names none is for — this node's own model (``--model``), else the one
    model the mesh serves; None when this node has none and the mesh serves several (the request must name one: a
    400 that lists them) or none at all."""
    if own is not None:
        return own
    return served[0] if len(served) == 1 else None


MAX_KNOWN_MODELS = 64  # names a node remembers the mesh serving (the oldest forgotten first)
GONE_RETRY_S = 10  # a model served before may be back soon (its node restarting): clients are told to ask again


@dataclass(frozen=True)
class Gone:
    """A request for a model the mesh served before and serves no more: 503, naming it."""

    reason: str
    retry_after_s: int = GONE_RETRY_S


def answer_as(asked: str, served: Sequence[str], known: Iterable[str]) -> str | Gone | None:
    """Which model answers a request that names ``asked``: the model itself where the mesh serves it; a 503 naming it
    where the mesh served it before (``known``: every name this node has seen it serve) and serves it no more; the
    one model served, under any name, only where the mesh has only ever served that one (clients configured for
    another name work, as with llama-server) — never another model in place of one that left; None (a 404 listing
    what is served) otherwise."""
    if asked in served:
        return asked
    if asked in known:
        now = ", ".join(served) or "none"
        return Gone(f"model {asked!r} is not served now: the nodes that served it left the mesh (served now: {now}); "
                    "it is answered again once one of them is back")  # fmt: skip
    if len(served) == 1 and set(known) <= set(served):
        return served[0]
    return None


def remember(known: dict[str, None], served: Iterable[str]) -> None:
    """``served`` into ``known`` (an ordered set, MAX_KNOWN_MODELS names at most, the oldest forgotten first)."""
    for name in served:
        known.pop(name, None)
        known[name] = None
    while len(known) > MAX_KNOWN_MODELS:
        del known[next(iter(known))]


def route(
    requested: str | None,
    served: list[str],
    local: LocalServing | None,
    remote: tuple[NodeId, str] | None,
    remote_listener_ready: bool,
    plan: Plan | Waiting | None,
    host: NodeId | None,
    me: NodeId,
    host_says: str = "",
) -> Route:
    """Where a request for ``requested`` (None: whatever the mesh serves) goes.

    ``served``: the model names live nodes announce; ``remote``: a peer announcing it serves that model, with the
    name it serves it under; ``remote_listener_ready``: whether our tunnel listener to that peer is up;
    ``host_says``: why a host that cannot serve says so in its record (every node then gives that reason)."""
    if requested is not None and served and requested not in served:
        return None
    if local is not None and local.state == "serving" and requested in (None, local.model):
        return Local(local.model)
    if local is not None and local.state in ("loading", "failed"):
        return Busy(local.reason or f"the model is {local.state}")
    if remote is not None:
        node, name = remote
        return Remote(node, name) if remote_listener_ready else Connecting(node)
    if isinstance(plan, Waiting):
        return Busy(plan.message())
    if host_says:
        return Busy(host_says)
    if host is None:
        return Busy("no host elected yet: waiting for peers")
    if host != me:  # it serves, as far as its record says, but we have no connection to it (yet)
        return Busy(f"connecting to the host {crypto.short(host)}")
    return Busy("starting the model server")


# ------------------------------------------------------------------------------------------------ llama-server


@dataclass(frozen=True)
class Solo:
    """Run llama-server on the whole model in this process (no RPC)."""


@dataclass(frozen=True)
class Split:
    """Run llama-server over RPC: the workers' tunnels first (their layers come first), this node's own device last,
    so the output layer and the logits stay here. ``own_rpc``: this node's layers go through its own rpc-server
    (a CPU host: llama.cpp cannot list the CPU as a device); otherwise they run inside llama-server on its local
    GPU, which llama.cpp puts after the RPC devices."""

    workers: tuple[NodeId, ...]
    tensor_split: tuple[int, ...]
    own_rpc: bool = True
    embd_first: bool = False  # the plan's: the token embedding on the first worker (patch 0013)


@dataclass(frozen=True)
class NeedTunnels:
    """The plan wants a split, but tunnel listeners (or connections) to these workers are missing: make them first,
    and keep whatever runs now."""

    missing: tuple[NodeId, ...]


@dataclass(frozen=True)
class NeedLayers:
    """The plan wants a split, but these workers hold a partial copy of the model and are still fetching the layers
    the plan gives them: keep whatever runs now until they have them."""

    workers: tuple[NodeId, ...]


@dataclass(frozen=True)
class NeedElected:
    """The plan wants a split, but these workers have not elected us yet (their records name another host, or
    none): they would refuse our llama-server's connections, and it would fail at its first. Keep whatever runs now
    until they do (HOST_WAIT_S at most)."""

    workers: tuple[NodeId, ...]


def not_electing(plan: Plan | Waiting | None, me: NodeId, host_of: Callable[[NodeId], NodeId | None]
                 ) -> frozenset[NodeId]:  # fmt: skip
    """The workers of ``plan`` (ours to host) whose records (``host_of``: the host each serves layers for) do not
    name us."""
    if not isinstance(plan, Plan) or plan.host != me:
        return frozenset()
    return frozenset(a.node for a in plan.workers if host_of(a.node) != me)


def lacking_layers(plan: Plan | Waiting | None, held: Callable[[NodeId], tuple[tuple[int, int], ...] | None]
                   ) -> frozenset[NodeId]:  # fmt: skip
    """The workers of ``plan`` whose partial copy (``held``: the layers each holds; None: the whole file) lacks a
    layer the plan gives them."""
    if not isinstance(plan, Plan):
        return frozenset()
    out = set()
    for a in plan.workers:
        h = held(a.node)
        if h is not None and not covers(h, a.first, a.count):
            out.add(a.node)
    return frozenset(out)


LAYER_WAIT_S = 600.0  # how long a split waits for a worker fetching its layers before it loads without them
HOST_WAIT_S = 5.0  # how long it waits for a worker to elect it (a worker of an older version never says)


@dataclass
class LayerWait:
    """The host's patience with workers still fetching their layers: it waits for each up to ``limit_s`` from when it
    began to (then it loads without them: their missing weights go over the network, the stock way). The same with
    workers that have not elected it yet (``HOST_WAIT_S``: then it starts llama-server anyway)."""

    limit_s: float = LAYER_WAIT_S
    since: dict[NodeId, float] = field(default_factory=dict)
    gave_up: set[NodeId] = field(default_factory=set)

    def step(self, lacking: frozenset[NodeId], now: float) -> tuple[frozenset[NodeId], list[NodeId], list[NodeId]]:
        """(the workers to wait for now, those it begins to wait for, those it stops waiting for this time)."""
        for n in set(self.since) - lacking:  # it has its layers, or left the plan: a later lack waits afresh
            del self.since[n]
            self.gave_up.discard(n)
        began = sorted(n for n in lacking if n not in self.since)
        for n in began:
            self.since[n] = now
        wait = frozenset(n for n in lacking if now - self.since[n] < self.limit_s)
        stopped = sorted(n for n in lacking - wait if n not in self.gave_up)
        self.gave_up.update(stopped)
        return wait, began, stopped


def covers(held: tuple[tuple[int, int], ...], first: int, count: int) -> bool:
    """Whether the layer ranges ``held`` (first, count) hold every layer of [first, first + count)."""
    have = {i for f, c in held for i in range(f, f + c)}
    return all(i in have for i in range(first, first + count))


def as_ranges(layers: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Layer numbers as (first, count) ranges, in order."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(layers)):
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return tuple(out)


ServerWant = Solo | Split | NeedTunnels | NeedLayers | NeedElected | None  # None: run no llama-server


def wanted_server(
    plan: Plan | Waiting | None,
    me: NodeId,
    can_host: bool,
    listeners: frozenset[NodeId],
    connected: frozenset[NodeId],
    has_accelerator: bool = False,
    lacking: frozenset[NodeId] = frozenset(),
    electing: frozenset[NodeId] = frozenset(),
) -> ServerWant:
    """The llama-server this node should run for ``plan``. ``can_host``: we have binaries and the model file;
    ``listeners``: workers we have tunnel listeners for; ``connected``: peers with a live connection;
    ``has_accelerator``: this node has a GPU (or other device) llama.cpp can run its layers on in-process;
    ``lacking``: workers still fetching their layers (the split waits for them, or their weights would go over
    the network); ``electing``: workers that have not elected us yet (the split waits for them)."""
    if not isinstance(plan, Plan) or plan.host != me or not can_host:
        return None
    if not plan.workers:
        return Solo()
    workers = tuple(a.node for a in plan.workers)
    missing = tuple(n for n in workers if n not in listeners)
    if missing:
        return NeedTunnels(missing)
    if not all(n in connected for n in workers):
        return NeedTunnels(())  # listeners are up but a worker's connection is not (yet): wait
    if any(n in lacking for n in workers):
        return NeedLayers(tuple(n for n in workers if n in lacking))
    if any(n in electing for n in workers):
        return NeedElected(tuple(n for n in workers if n in electing))
    return Split(workers, tuple(plan.tensor_split), own_rpc=not has_accelerator, embd_first=plan.embd_first)


def ram_flags(plan: Plan, me: NodeId, endpoints: Mapping[NodeId, str]) -> tuple[str, ...]:
    """Llama-server's flags that put what ``plan`` keeps in RAM there: the host's (``me``) layers' routed
    experts in its own CPU buffers, a worker's in its rpc-server's CPU device (the one after its accelerators,
    named ``RPC<index>[<endpoint>]`` by llama.cpp, ``endpoints`` being the addresses given to --rpc; a worker
    without an accelerator has that one device only: nothing to move). --rpc must come before these on the command
    line: llama.cpp looks the buffers up as it parses. (The host's whole layers in RAM: ``Plan.n_gpu_layers``.)"""
    out: list[str] = []
    for a in plan.assignments:
        if not a.spilled:
            continue
        if a.node == me:
            out += ["--override-tensor", experts_override(a.spilled)]
        elif a.cpu_last:
            cpu = f"RPC{max(1, len(a.shares))}[{endpoints[a.node]}]"  # its devices: accelerators, then the CPU
            out += ["--override-tensor", experts_override(a.spilled, cpu)]
    return tuple(out)


# ------------------------------------------------------------------------------------------------ RPC admission


def may_open_rpc(peer: NodeId | None, elected: NodeId | None, rpc_server_up: bool) -> bool:
    """Whether ``peer`` may open an RPC stream to our rpc-server (whoever reaches it owns this machine): only the
    host this node itself elected, from its own view of the mesh. What a peer says of itself in gossip (its role,
    the model it hosts) is never enough: any member could say it. A new host that dials before this node's view
    has moved is refused for a moment; its llama-server restarts and gets through once the views agree."""
    return peer is not None and rpc_server_up and peer == elected


# ------------------------------------------------------------------------------------------------ connections


def designated_dialler(a: NodeId, b: NodeId) -> NodeId:
    """Of a pair of nodes, the one that dials the other (the smaller NodeId). The mesh core dials by this rule and
    a duplicate connection is settled by it: both ends must agree, so it lives here once."""
    return min(a, b)


def keep_existing(
    existing_direct: bool, new_direct: bool, existing_dialled_by_me: bool, me: NodeId, peer: NodeId,
    new_dialled_by_me: bool | None = None,
) -> bool:
    """Two connections for one pair of nodes: whether to keep the one we had (else the new one). A direct connection
    beats a relayed one; one side that dialled both lost the first (a node dials only a peer it has no connection
    to: it restarted, perhaps after a kill -9 the other end has not noticed yet), so the new one stays; otherwise
    the one the designated dialler dialled survives. Both ends compute this from their own side and reach the same
    answer, so exactly one connection stays."""
    if existing_direct != new_direct:
        return existing_direct
    if new_dialled_by_me is not None and new_dialled_by_me == existing_dialled_by_me:
        return False  # before: the dead connection was kept and the restarted node got no gossip until it timed out
    dialler = me if existing_dialled_by_me else peer
    return dialler == designated_dialler(me, peer)


# ------------------------------------------------------------------------------------------------ the RPC path


class RpcPath(StrEnum):
    """How the host's llama-server reaches a worker's rpc-server."""

    DIRECT = "direct"  # TCP straight to the worker's TLS listener (TLS 1.3, a pre-shared key per host and plan)
    TUNNEL = "tunnel"  # plain TCP to a local listener, carried in a QUIC stream (over a direct or relayed path)


NO_DIRECT_PATH = b"no direct path"  # a worker's answer to its host's key request when it has no TLS listener
DIRECT_RETRY_S = 300.0  # a direct path that failed is not tried again for this long (the tunnel serves meanwhile)


def try_direct(mode: str, tls_here: bool, quic_direct: bool, ip: str, failed_until: float | None, now: float) -> bool:
    """Whether to try the direct path to a worker: ``mode`` "auto" (the default; "tunnel" turns it off), both
    builds speak TLS (``tls_here``; the worker's shows in its key answer), our QUIC connection to it is not relayed
    (through a NAT a TCP port is out of reach), we know its address (IPv4 or IPv6: patch 0012), and the path has
    not failed lately. The TCP probe and the key exchange decide the rest."""
    if mode != "auto" or not tls_here or not quic_direct or not ip:
        return False
    return failed_until is None or now >= failed_until


def unreachable_workers(log_tail: str, direct: dict[NodeId, str]) -> list[NodeId]:
    """The workers of ``direct`` (worker -> "ip:port") whose endpoint a dead llama-server could not connect to, from
    its log: ggml-rpc aborts with "Failed to connect to ENDPOINT". Those go through their tunnel next."""
    failed = set(re.findall(r"Failed to connect to (\S+)", log_tail))
    return [w for w, ep in direct.items() if ep in failed]


@dataclass(frozen=True)
class RpcKey:
    """A worker's answer to its elected host's key request: the identity and pre-shared key its rpc-server's TLS
    listener accepts now (the only ones), and that listener's port; ``peer``: the port of its rpc-server's listener
    for its predecessor in a split (worker to worker, patch 0011), 0 when it has none."""

    identity: str
    key: bytes
    port: int
    peer: int = 0

    def encode(self) -> bytes:
        return msgpack.packb({"id": self.identity, "key": self.key, "port": self.port, "peer": self.peer})

    @classmethod
    def decode(cls, raw: bytes) -> RpcKey | None:
        """None for anything but a well-formed answer."""
        try:
            d = msgpack.unpackb(raw)
        except (ValueError, TypeError, msgpack.UnpackException):
            return None
        if not isinstance(d, dict):
            return None
        ident, key, port = d.get("id"), d.get("key"), d.get("port")
        if not (isinstance(ident, str) and 0 < len(ident) <= 64 and ident.isascii() and ident.isprintable()):
            return None
        if " " in ident or not isinstance(key, bytes) or len(key) != 32:
            return None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            return None
        peer = d.get("peer", 0)  # absent from a worker of before patch 0011
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < 65536:
            return None
        return cls(ident, key, port, peer)


@dataclass(frozen=True)
class LogFacts:
    """What a llama-server's log says of its rpc endpoints: those whose hidden state goes straight to the next worker
    (patch 0011 says "rpc peer link A -> B: server to server" once per pair, or "through this process" when the pair
    has no link), and the one holding the token embedding (patch 0013: "token embedding on EP, with layer 0")."""

    links: frozenset[str]
    embedding: str | None


def log_facts(log: str) -> LogFacts:
    links = frozenset(m.group(1) for m in re.finditer(r"(?m)^rpc peer link (\S+) -> \S+: server to server$", log))
    embd = re.search(r"(?m)^token embedding on (\S+), with layer 0$", log)
    return LogFacts(links, embd.group(1) if embd else None)


def peer_listeners(
    workers: Sequence[NodeId], direct: Mapping[NodeId, str], peer: Mapping[NodeId, str]
) -> tuple[str, ...]:
    """What the host's llama-server needs to send a split's activations from one worker straight to the next
    (``GGML_RPC_PEERS``, patch 0011): "ENDPOINT=IP:PORT" for each of ``workers`` (in the split's order) that it
    reaches directly (``direct``: worker -> its endpoint) and whose rpc-server listens for a predecessor (``peer``:
    worker -> "IP:PORT"). Nothing unless two neighbours both qualify: a worker behind a tunnel keeps the star (its
    address is not one another worker can reach)."""
    ok = [n in direct and n in peer for n in workers]
    if not any(a and b for a, b in itertools.pairwise(ok)):
        return ()
    return tuple(f"{direct[n]}={peer[n]}" for n, good in zip(workers, ok, strict=True) if good)


def tunnel_peer_entries(
    workers: Sequence[NodeId], endpoints: Mapping[NodeId, str], forwarders: Mapping[tuple[NodeId, NodeId], int]
) -> tuple[str, ...]:
    """``GGML_RPC_PEERS`` for a split whose workers the host reaches through their tunnels: each worker's hidden
    state goes to the next one over the mesh (a loopback forwarder on the sender's machine, ``forwarders[(a, b)]``,
    whose streams the receiver's node bridges to its rpc-server's predecessor listener). Patch 0011 reads one
    "ENDPOINT=IP:PORT" per worker (``endpoints``: the host's rpc endpoint for it) as both where its predecessor
    connects and the address its own connections come from at its successor: here both are 127.0.0.1 (a forwarder,
    and a bridge on loopback). The first worker has no predecessor: its port is never dialled. All or nothing: a
    pair without a forwarder would be tried and refused; then the whole split keeps the star."""
    if len(workers) < 2 or not all(pair in forwarders for pair in itertools.pairwise(workers)):
        return ()
    out = [f"{endpoints[workers[0]]}=127.0.0.1:1"]
    out += [f"{endpoints[b]}=127.0.0.1:{forwarders[(a, b)]}" for a, b in itertools.pairwise(workers)]
    return tuple(out)


def predecessor(plan: Plan | Waiting | None, me: NodeId) -> NodeId | None:
    """The worker right before ``me`` in ``plan``'s split (whose hidden state ``me`` takes), if any."""
    if not isinstance(plan, Plan):
        return None
    order = [a.node for a in plan.workers]
    i = order.index(me) if me in order else 0
    return order[i - 1] if i > 0 else None


def may_open_peer(peer: NodeId | None, me: NodeId, plan: Plan | Waiting | None, elected: NodeId | None) -> bool:
    """Whether ``peer`` may send our rpc-server a hidden state through the mesh (worker to worker over tunnels): only
    the worker right before us in the plan of the host we elected ourselves. The rpc-server then still wants the
    key the host's llama-server made for that pair."""
    return (peer is not None and isinstance(plan, Plan) and plan.host == elected
            and predecessor(plan, me) == peer)  # fmt: skip


def keep_first(
    me: NodeId, host: NodeId, current: Plan | Waiting | None, host_planned: tuple[NodeId, ...]
) -> set[NodeId]:
    """The nodes a new plan keeps first (a change costs a model reload). The host keeps those of the plan it runs;
    every other node takes them from the host's record — a preference of its own (from the order it happened to see
    joins in) once kept two nodes on two different plans for good."""
    if host == me:
        return {a.node for a in current.assignments} if isinstance(current, Plan) else set()
    return set(host_planned)
