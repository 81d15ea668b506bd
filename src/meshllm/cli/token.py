"""``mesh-llm token [--ttl D] [--scope S]``: a new invite token for the mesh the node in the state dir belongs to
(``serve/life/joining.mint_invite``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from meshllm.cli import args as a


def add(sub: Any) -> None:
    p = sub.add_parser("token", help="mint a new invite token (reads this node's state dir)",
                       description="Print a new invite token for the mesh this node belongs to.")  # fmt: skip
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    p.add_argument("--ttl", type=a.parse_duration, default=86400.0, metavar="DURATION",
                   help="how long it admits new nodes, e.g. 30m, 12h, 7d (default 1d; 30d at most)")  # fmt: skip
    p.add_argument("--scope", type=a.scope, metavar="SCOPE",
                   help="what the new node may do: client (the API only), worker (serve layers, never host), host "
                   "(may be elected host). Default: this node's own scope, the widest it may give")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.paths import state_dir
    from meshllm.serve.life.joining import mint_invite

    said, token = mint_invite(state_dir(args.state_dir), args.ttl, args.scope)
    print(said, file=sys.stderr)
    print(token)  # alone on stdout: `mesh-llm token > file` keeps only the token
    return 0
