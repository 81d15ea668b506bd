"""``mesh-llm status``: the running node's view of the mesh (peers, roles, layers, paths, RTT), from its API or
from what a node last wrote into its state dir."""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console

from meshllm.cli import args as a
from meshllm.cli import console
from meshllm.errors import UserError


def add(sub: Any) -> None:
    what = "The node's view of the mesh: peers, roles, layers, paths (QUIC and RPC), RTT."
    ps = sub.add_parser("status", help="show the running node's view of the mesh", description=what)
    ps.add_argument("--port", type=a.tcp_port, default=9337, help="the node's API port (default 9337)")
    ps.add_argument("--api-key", default=os.environ.get("MESH_LLM_API_KEY"),
                    help="the node's API key, if it runs with --listen-all (or $MESH_LLM_API_KEY)")  # fmt: skip
    ps.add_argument(
        "--state-dir", type=Path, metavar="DIR", help="read the status the node last wrote into DIR instead"
    )
    ps.add_argument("--json", action="store_true", help="the raw /mesh/status JSON")
    ps.add_argument("--events", type=a.events_n, default=5, metavar="N",
                    help="the latest N events of the timeline (joins, leaves, elections, plans); default 5, 0: none")
    ps.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.serve.report.tables import print_status

    if args.state_dir is not None:  # what the node last wrote there (it need not be running)
        from meshllm.machine.state import running_pid
        from meshllm.paths import state_dir

        path = state_dir(args.state_dir) / "status.json"
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"no status in {path} ({e}): start the node with this --state-dir first") from None
        if running_pid(state_dir(args.state_dir)) is None and not args.json:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
            console.print(f"[yellow]stopped: no node runs on {path.parent}; what it last said, at {when}:[/]")
    else:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        req = urllib.request.Request(f"http://127.0.0.1:{args.port}/mesh/status", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                st = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"no mesh-llm answering on 127.0.0.1:{args.port} ({e}); pass --port") from None
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print_status(Console(highlight=False), st, args.events)
    return 0
