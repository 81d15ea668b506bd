"""``mesh-llm approve [NODE] [--scope S]``: the nodes waiting at the running founder (or admin) after knocking from
the LAN (``--join-lan``), or a token of that scope for one of them, handed over at its next knock
(``serve/life/lan.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshllm.cli import args as a
from meshllm.proto import token as tok


def add(sub: Any) -> None:
    p = sub.add_parser("approve", help="let in a node that asked to join from the LAN (--join-lan)",
                       description="Without NODE: the nodes waiting for approval at the running node (the founder or "
                       "an admin, which announces the mesh on the LAN). With NODE: an invite token of --scope for it, "
                       "which the running node hands it at its next knock.")  # fmt: skip
    p.add_argument("node", nargs="?", metavar="NODE", help="its id as the list shows it (4 or more hex digits)")
    p.add_argument("--scope", type=a.scope, default=tok.Scope.WORKER, metavar="SCOPE",
                   help="what it may do: client (the API only), worker (serve layers, never host; the default), "
                   "host (may be elected host)")  # fmt: skip
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import member_state
    from meshllm.paths import state_dir
    from meshllm.serve.life.lan import approve

    sd = state_dir(args.state_dir)
    member_state(sd)
    print(approve(sd, args.node, args.scope))
    return 0
