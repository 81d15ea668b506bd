"""``mesh-llm ps [--json]``: the nodes running on this machine as this user (``machine/registry.py``)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("ps", help="list the mesh-llm nodes running on this machine",
                       description="Each node running here: state dir, pid, model, API URL, state.")  # fmt: skip
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.registry import running_nodes

    nodes = running_nodes()
    if args.json:
        print(json.dumps(nodes, indent=1))
        return 0
    if not nodes:
        print("no mesh-llm node runs on this machine (as this user)")
        return 0
    rows = [("STATE DIR", "PID", "MODEL", "API", "STATE")]
    rows += [(n["state_dir"], str(n["pid"]), n["model"] or "-", n["api"], n["state"]) for n in nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return 0
