"""``mesh-llm stop [--state-dir DIR | --all]``: SIGTERM to the node holding a state dir's lock (by pid, never by
name), then a wait: it leaves the mesh cleanly (``machine/registry.stop``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("stop", help="stop the node running on a state dir (it leaves the mesh cleanly)",
                       description="SIGTERM to the node holding the state dir's lock, then a wait.")  # fmt: skip
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    p.add_argument("--all", action="store_true", help="every node `mesh-llm ps` lists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.registry import running_nodes, stop
    from meshllm.paths import state_dir

    targets = [Path(n["state_dir"]) for n in running_nodes()] if args.all else [state_dir(args.state_dir)]
    if args.all and not targets:
        print("no mesh-llm node runs on this machine (as this user)")
    for state in targets:
        print(stop(state))
    return 0
