"""The tables and lines ``mesh-llm status`` and ``mesh-llm download`` print: a node's status JSON as people read it
(fits 80 columns), and the model catalog. Formatting only: the command line fetches, this prints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def print_status(out: Console, st: dict[str, Any], events: int = 0) -> None:
    """``st``: a node's status JSON; ``events``: the last this many of its timeline too."""
    plan = st.get("plan") or {}
    # a lite client elects no host of its own: the host is whoever says so
    host = st.get("host") or next((p["node"] for p in st["peers"] if p["role"] == "host"), "") or ""
    models = [m for m in st.get("models") or [] if isinstance(m, dict)]
    if len(models) > 1:  # each model has its own host
        host = ", ".join(f"{str(m['host'] or 'none')[:8]} ({m['name']})" for m in models)
        out.print(f"node {st['node'][:8]} ({st['role']}) in mesh {st['mesh'][:8]} — hosts {host}", soft_wrap=True)
    else:
        out.print(f"node {st['node'][:8]} ({st['role']}) in mesh {st['mesh'][:8]} — host {host[:8] or 'none'}")
    served = ", ".join(st.get("served_models") or []) or "none yet"
    out.print(f"model: {served} — API {st.get('api', '?')}", soft_wrap=True)
    why = st.get("unavailable")
    if why:  # what /health and a request's 503 say
        out.print(f"[yellow]{why}[/]", soft_wrap=True)
    else:
        out.print(f"[green]{state_text(str(st.get('state', '?')), str(st.get('why') or ''))}[/]")
    # fits 80 columns: a path's words go onto lines of their own, an address is never broken (IPv4:port: 21 chars)
    t = Table(box=None, pad_edge=False)
    for name, justify in (("node", "left"), ("role", "left"), ("state", "left"), ("memory", "right"),
                          ("layers", "left"), ("path, RTT", "left")):  # fmt: skip
        t.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("path, RTT", "state"),  # type: ignore[arg-type]
                     min_width=21 if name == "path, RTT" else None)  # fmt: skip
    order = {m["fingerprint"]: i for i, m in enumerate(models)}  # the table grouped by model, lite clients last
    for p in sorted(st["peers"], key=lambda p: order.get(p.get("model"), len(order))):
        layers = p.get("layers")
        span = f"{layers[0]}-{layers[1]}" if layers else ""
        if isinstance(plan, dict) and p["node"] == plan.get("host"):
            span = f"{span} + output" if span else "output"  # the host's share always has the output layer
        used = p.get("planned_bytes")  # what the plan puts there, of what the node offers
        share = f"{used / 1e9:.1f}/" if used else ""
        mem = f"{share}{p['capacity'] / 1e9:.1f} GB {p.get('device') or ''}".strip() if p["capacity"] else "-"
        ram_used = f"{p['planned_ram_bytes'] / 1e9:.1f}/" if p.get("planned_ram_bytes") else ""
        mem += f"\n+ {ram_used}{p['ram'] / 1e9:.1f} GB RAM" if p.get("ram") and p["capacity"] else ""
        state = p["state"]  # one vocabulary, as every node computes it (proto/standing.py); the reason below
        name = str(p.get("name") or "")[:12]  # a second line under the id: the hostname or --name
        t.add_row(
            p["short"] + (f"\n{name}" if name else ""), p.get("label", p["role"]), state, mem, span or "-",
            # the RTT with the path (a column of its own fell off at 80 columns); "[v6]:port": not markup
            Text(p["path"] + (f" · {p['rtt_ms']:.1f} ms" if p.get("rtt_ms") is not None and p["path"] != "self" else "")
                 + (f"\nRPC {p['rpc_path']}" if p.get("rpc_path") else "")),
        )  # fmt: skip
    out.print(t)
    if len(models) > 1 or any(m.get("replicas") for m in models):
        for m in models:
            nodes = ", ".join(str(n)[:8] for n in m["nodes"])
            reps = ", ".join(str(n)[:8] for n in m.get("replicas") or [])
            reps = f"; replicas {reps}" if reps else ""  # hosts of it beside the elected one
            tk, sl = m.get("tokens") or {}, m.get("slots") or {}  # each model's own figures
            figs = (f"; {tk['generated']} tokens, {tk['rate']:.1f} tok/s now; slots {sl['busy']} of {sl['total']} busy"
                    if tk and sl else "")  # fmt: skip
            out.print(f"  {m['name']}: host {str(m['host'] or 'none')[:8]} {m['state']}{reps}; nodes {nodes}{figs}",
                      markup=False)  # fmt: skip
    if st.get("dropped"):
        out.print(f"  dropped by the founder or an admin: {', '.join(map(str, st['dropped']))}", markup=False)
    r = st.get("reach") or {}
    if r.get("relay_server"):  # what it forwards for others, and its cap per pair
        cap = f"at most {r['relay_rate'] / 2**20:g} MB/s per pair" if r.get("relay_rate") else "no cap per pair"
        out.print(f"  relaying for members: {r.get('relay_pairs', 0)} pairs lately, {r['relayed_bytes'] / 1e6:.1f} MB "
                  f"forwarded, {cap} ({r.get('relay_capped', 0)} packets over it dropped)", markup=False)  # fmt: skip
    for p in st["peers"]:
        if p.get("why"):
            out.print(f"  {p['short']}: {state_text(p['state'], p['why'])}", markup=False)
        if isinstance(p.get("held"), list):  # fetched only its layers (--fetch layers): it never hosts
            held = ", ".join(f"{f}-{f + n - 1}" for f, n in p["held"]) or "no layer yet"
            out.print(f"  {p['short']}: a partial copy of the model, holding layers {held}", markup=False)
    mt, tt = st.get("mesh_tokens"), st.get("ttft_s")
    if isinstance(mt, dict):
        host = f" (host {mt['host']})" if mt.get("host") else ""
        every = " (every model's hosts)" if len(models) > 1 else ""  # a sum, said so
        out.print(f"mesh{every}: {mt['generated']} tokens generated, {mt['prompt']} prompt tokens{host}; "
                  f"{mt.get('rate', 0):.1f} tok/s now")  # fmt: skip
    fetch = st.get("fetch")
    if isinstance(fetch, dict):
        out.print(f"fetching {fetch['name']} from {fetch['sources']} peer{'s' if fetch['sources'] != 1 else ''}: "
                  f"{fetch['percent']}%, "
                  f"{fetch['mb_per_s']} MB/s")  # fmt: skip
    flight = st.get("in_flight")
    if flight:
        out.print(f"in flight here: {flight} request{'s' if flight != 1 else ''}")
    sl = st.get("slots")
    if isinstance(sl, dict) and sl.get("total"):
        out.print(f"slots: {sl['busy']} of {sl['total']} busy, {sl['queued']} waiting; "
                  f"{sl['ctx']} tokens of context each")  # fmt: skip
    mtt = st.get("mesh_ttft_s")
    if isinstance(mtt, dict):
        out.print(f"first token: {mtt['avg'] * 1000:.0f} ms on average over the mesh's {mtt['count']} requests")
    if isinstance(tt, dict):
        out.print(f"first token via this node: {tt['last'] * 1000:.0f} ms last, median <= {tt['p50'] * 1000:.0f} ms "
                  f"({tt['count']} requests)")  # fmt: skip
    for ev in (st.get("events") or [])[-events:] if events else []:
        out.print(f"{time.strftime('%H:%M:%S', time.localtime(ev['t']))} {ev['text']}", markup=False)


def state_text(state: str, why: str) -> str:
    from meshllm.proto.standing import Standing, State

    try:
        return Standing(State(state), why).text()
    except ValueError:  # a status written by another version
        return f"{state}: {why}" if why else state


def print_catalog(out: Console, where: Path, tiny_installed: bool) -> None:
    """``mesh-llm download``: the catalog, and which of its models are in ``where``."""
    from rich import box

    from meshllm.models import catalog
    from meshllm.models.download import installed

    # the names are what users type: never cut, at any width (the aliases fold instead)
    t = Table(title=f"models ({where})", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("name", no_wrap=True)
    t.add_column("GB", justify="right", no_wrap=True)
    t.add_column("needs", justify="right", no_wrap=True)
    t.add_column("draft", no_wrap=True)
    t.add_column("have", no_wrap=True)
    longest = max((len(a) for e in catalog.CATALOG for a in e.aliases), default=4)
    t.add_column("also", min_width=longest)  # wraps between aliases, never inside one
    for e in catalog.CATALOG:
        have = "yes" if (e.pypi and tiny_installed) or installed(e.files[0], where) else ""
        t.add_row(e.name, f"{e.size_gb:.2f}", f"{e.memory_gb:.1f}", e.draft or "-", have, ", ".join(e.aliases))
    out.print(t)
    out.print("GB: the download; needs: about what serving it takes (+15 %). mesh-llm download NAME [--draft]")
