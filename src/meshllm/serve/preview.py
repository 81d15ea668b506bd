"""``mesh-llm plan MODEL`` — what the mesh as it stands would do with a model, without loading it: which node
would host, each node's layers and memory, the slots and context it would get; or how much memory it lacks.

"The mesh as it stands" is what the node running on the state dir last wrote (``status.json``): its members, their
offered memory, scope and RTT as that node measured them; with no node running, this machine alone (what its
llama.cpp build sees, else three quarters of its RAM). The host is picked as the election picks it (most memory
among host-scoped members; ties to the highest node id) and the plan is the planner's own (``proto/sizing.size``).
Memory is the planner's estimate (weights, KV cache, compute buffers); it is not measured here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshllm.errors import MeshError, UserError
from meshllm.proto.layout import GB, ModelShape, Plan, Slot, Waiting
from meshllm.proto.serving import as_ranges
from meshllm.proto.sizing import Sizing, size


def mesh_slots(status: dict[str, Any]) -> tuple[Slot, list[Slot], dict[bytes, str]] | None:
    """The host the election would pick and the other nodes that may serve layers, from a node's status; with a
    label per node for people. None when no member may host."""
    peers = [p for p in status.get("peers", []) if isinstance(p, dict)]
    usable = [p for p in peers if p.get("role") != "client" and p.get("scope") in ("worker", "host")
              and int(p.get("capacity") or 0) > 0]  # fmt: skip
    hosts = [p for p in usable if p.get("scope") == "host"]
    if not hosts:
        return None
    h = max(hosts, key=lambda p: (int(p["capacity"]), p["node"]))
    me = status.get("node")

    def slot(p: dict[str, Any]) -> Slot:
        rtt = 0.0 if p["node"] == me else float(p.get("rtt_ms") or 0.0)
        return Slot(bytes.fromhex(p["node"]), int(p["capacity"]), rtt, str(p.get("name") or ""),
                    prompts=p.get("scope") == "host", ram=int(p.get("ram") or 0),
                    gpu=(p.get("device") or "cpu") != "cpu")  # fmt: skip

    labels = {bytes.fromhex(p["node"]): f"{p.get('short', p['node'][:8])} \"{p.get('name', '')}\" "
              f"({p.get('device') or 'cpu'}, {int(p['capacity']) / GB:.1f} GB offered)" for p in usable}  # fmt: skip
    return slot(h), [slot(p) for p in usable if p is not h], labels


def describe(model: str, shape: ModelShape, file_size: int, got: tuple[Plan | Waiting, Sizing],
             labels: dict[bytes, str], where: str) -> list[str]:
    """The preview's lines."""
    plan, sizing = got
    head = f"{model} ({file_size / 1e9:.2f} GB, {shape.n_layer} layers) on {where}:"
    if isinstance(plan, Waiting):
        return [head, f"  would not load: {plan.message()}"]
    lines = [head]
    if plan.ram_layers:  # llama.cpp's --n-gpu-layers: the host's CPU runs them, ahead of every device
        span = f"layers 0–{plan.ram_layers - 1}" if plan.ram_layers > 1 else "layer 0"
        lines.append(f"  host   {labels.get(plan.host, plan.host.hex()[:8])}: {span} whole in RAM")
    for i, a in enumerate(plan.assignments):
        role = "host  " if a.node == plan.host else "worker"
        ranges = as_ranges(range(a.first, a.first + a.count))
        span = ", ".join(f"{f}–{f + c - 1}" if c > 1 else str(f) for f, c in ranges)
        what = f"layers {span}" if a.count else "no repeating layer"
        if a.node == plan.host:
            what += " + output" + ("" if plan.embd_first else " + token embedding")
        elif i == 0 and plan.embd_first:
            what += " + token embedding"
        if a.spilled:  # routed experts in the node's RAM
            what += f" (layers {a.spilled[0]}–{a.spilled[-1]}: attention here, routed experts in RAM)"
        if a.ram_bytes:
            what += f", {a.ram_bytes / GB:.2f} GB in RAM"
        lines.append(f"  {role} {labels.get(a.node, a.node.hex()[:8])}: {what}, {a.bytes / GB:.2f} GB planned")
    for n in plan.standby:
        lines.append(f"  unused {labels.get(n, n.hex()[:8])}")
    lines.append(f"  slots: {sizing.parallel} × {sizing.ctx} tokens of context")
    return lines


def preview(model_arg: str, state: Path, models_dir: Path | None, parallel: int | None, ctx: int | None,
            cache: str = "f16") -> list[str]:  # fmt: skip
    from meshllm.llama.gguf import read_header
    from meshllm.machine.state import running_pid
    from meshllm.models.download import resolve
    from meshllm.serve.fetch.modelfiles import model_shape

    path = resolve(model_arg, models_dir, fetch=False)
    if not path.is_file():
        raise UserError(f"{model_arg}: no such model on this machine (`mesh-llm download` fetches catalog models)")
    hdr = read_header(path)
    shape = model_shape(hdr)
    status: dict[str, Any] = {}
    if running_pid(state) is not None:
        try:
            status = json.loads((state / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
    found = mesh_slots(status) if status else None
    if found is not None:
        host, others, labels = found
        where = f"the mesh as node {str(status.get('node', ''))[:8]} sees it ({1 + len(others)} nodes that may serve)"
    else:
        host, others, labels = _this_machine()
        where = "this machine alone (no node runs on " + str(state) + ")"
    return describe(path.name, shape, hdr.file_size, size(shape, host, others, parallel, ctx, cache), labels, where)


def _this_machine() -> tuple[Slot, list[Slot], dict[bytes, str]]:
    import asyncio

    from meshllm.llama.build import find_binaries
    from meshllm.serve.options import measure_offer

    try:
        bins = find_binaries()
    except MeshError:  # not built yet: RAM alone
        bins = None
    offer = asyncio.run(measure_offer(bins, None))
    me = b"\0" * 32
    return Slot(me, offer.capacity, ram=offer.ram, gpu=offer.use is not None), [], {
        me: f"this machine ({offer.device}, {offer.capacity / GB:.1f} GB offered)"}
