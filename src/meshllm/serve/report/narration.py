"""The lines a node prints on its console about the mesh: peers joining, leaving and dying, elections, plans, and
the ready line with its agent launch lines. Formatting only: each function returns the text."""

from __future__ import annotations

from rich.markup import escape

from meshllm.proto import crypto
from meshllm.proto.crypto import NodeId
from meshllm.proto.layout import GB, Assignment, Plan, Waiting
from meshllm.proto.meshcore import EventKind
from meshllm.proto.record import PeerRecord


def name(node: NodeId, me: NodeId) -> str:
    return crypto.short(node) + (" (me)" if node == me else "")


def event_line(
    kind: EventKind, node: NodeId, me: NodeId, detail: str, rec: PeerRecord | None, path: str, rtt: float | None
) -> str | None:
    """A mesh event as one console line (None: not worth one)."""
    who = name(node, me)
    if kind == EventKind.JOINED:
        cap = f"{rec.capacity / GB:.1f} GB" if rec and rec.capacity else "no capacity"
        return f"[green]+[/] peer {who} joined: {rec.role if rec else '?'}, {cap}, {escape(path)}" + (
            f", RTT {rtt:.1f} ms" if rtt is not None else ""
        )
    if kind in (EventKind.LEFT, EventKind.DIED):
        how = "left" if kind == EventKind.LEFT else "went silent and is declared dead"
        return f"[red]-[/] peer {who} {how}"
    if kind == EventKind.HOST:
        return f"[bold]host elected:[/] {who}"
    if kind == EventKind.REVOKED:
        if node == me:
            return "[bold red]this node was revoked from the mesh: no member takes it again[/]"
        return f"[red]-[/] peer {who} revoked from the mesh (itself, or the member that admitted it)"
    if kind == EventKind.DIRECTIVE:  # detail: "serve NAME" / "drop NAME"
        verb, _, model = detail.partition(" ")
        if verb == "drop":
            return f"[yellow]{who} dropped model {model} from the mesh: no node serves it (`mesh-llm serve {model}`)[/]"
        return f"{who} asked the mesh to serve model {model}"
    if kind == EventKind.REKEYED:
        return f"[yellow]the mesh's admission secret was rotated ({detail}): tokens minted before admit nobody now[/]"
    if kind == EventKind.EXPIRED:
        if node == me:
            return f"[bold red]this node's {detail}[/]"
        return f"[red]-[/] peer {who}'s admission ended (not renewed in time): it is out"
    if kind == EventKind.REFUTED:
        return f"[yellow]was declared dead by a peer; back as {detail}[/]"
    return None


def plan_line(p: Plan | Waiting, me: NodeId, elected: NodeId | None = None) -> str:
    """The plan this node follows: ``elected`` its model's elected host (another than the plan's: a replica)."""
    if isinstance(p, Plan) and p.host == me and elected not in (None, me):
        size = sum(a.bytes for a in p.assignments) / GB
        with_ = ", ".join(name(a.node, me) for a in p.assignments if a.node != me and a.count)
        if with_:  # a replica that is a split
            return f"[bold]replica:[/] this node hosts a split of the model ({size:.2f} GB) with {with_} beside host " \
                   f"{name(elected, me)}"
        return f"[bold]replica:[/] this node serves the whole model ({size:.2f} GB) beside host {name(elected, me)}"
    if isinstance(p, Waiting):
        hint = "" if p.why else " — to add one: `mesh-llm token` here, then `mesh-llm --model MODEL --join TOKEN` there"
        return f"[yellow]{p.message()}[/]{hint}"
    parts = [f"{name(a.node, me)} layers {a.first}-{a.first + a.count - 1}"
             f"{' + token embedding' if p.embd_first and i == 0 else ''} ({a.bytes / GB:.2f} GB){_spill(a)}"
             for i, a in enumerate(p.assignments) if a.count]  # fmt: skip
    if p.ram_layers:  # llama.cpp runs them on the host's CPU, ahead of every device
        parts.insert(0, f"{name(p.host, me)} layers 0-{p.ram_layers - 1} whole in RAM")
    standby = f"; standby: {', '.join(name(n, me) for n in p.standby)}" if p.standby else ""
    return f"[bold]plan:[/] {'; '.join(parts)} + output on host{standby}"


def _spill(a: Assignment) -> str:
    """Where a node's layers keep their routed experts in RAM: which, and how much."""
    if not a.spilled:
        return ""
    span = f"{a.spilled[0]}-{a.spilled[-1]}" if len(a.spilled) > 1 else str(a.spilled[0])
    return f" — layers {span}: attention here, experts in RAM ({a.ram_bytes / GB:.2f} GB)"


def api_line(api_host: str, port: int, host: PeerRecord | None, me: NodeId) -> str:
    """A worker's or lite client's API is up: requests to it go to the host."""
    model = host.model.source if host and host.model else "?"
    via = name(host.node, me) if host else "?"
    role = "replica" if host is not None and host.replica else "host"  # one of its hosts beside the elected
    return f"[bold green]API up:[/] http://{api_host}:{port}/v1 — model {model}, served by {role} {via}"


def duration(seconds: float) -> str:
    """A duration for people: "45 s", "30 min", "12 h", "1 d 12 h" (never "0 h" for half an hour)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min" + (f" {s % 60} s" if s % 60 else "")
    if s < 86400:
        return f"{s // 3600} h" + (f" {s % 3600 // 60} min" if s % 3600 // 60 else "")
    return f"{s // 86400} d" + (f" {s % 86400 // 3600} h" if s % 86400 // 3600 else "")
