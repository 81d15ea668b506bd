"""``mesh-llm admin NODE`` (the founder only): name a member admin, who may then revoke others too
(``machine/words.grant_admin``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshllm.cli import args as a


def add(sub: Any) -> None:
    p = sub.add_parser("admin", help="let a member revoke others too (the founder only)",
                       description="Name a member admin: signed by this node (the mesh's founder), written to its "
                       "state dir, gossiped by the running node. An admin may `mesh-llm revoke` members, never the "
                       "founder or another admin; revoking the admin ends that.")  # fmt: skip
    p.add_argument("node", type=a.nonempty, help="the member's node id (8+ hex digits as `mesh-llm status` shows)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the founder's state (default ~/.mesh-llm)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import grant_admin
    from meshllm.paths import state_dir

    print(grant_admin(state_dir(args.state_dir), args.node))
    return 0
