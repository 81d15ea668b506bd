"""``mesh-llm revoke NODE`` (the founder or an admin): a member, and every node it admitted, cut off the mesh for
good (``machine/words.revoke``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshllm.cli import args as a


def add(sub: Any) -> None:
    p = sub.add_parser("revoke", help="cut a member off the mesh for good (the founder or an admin)",
                       description="Revoke a member: signed by this node (the mesh's founder or an admin it named), "
                       "written to its state dir, gossiped by the running node. The member, and every node it "
                       "admitted, is dropped by every member and refused from then on, whatever chain or token it "
                       "shows.")  # fmt: skip
    p.add_argument("node", type=a.nonempty, help="the member's node id (8+ hex digits as `mesh-llm status` shows)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import revoke
    from meshllm.paths import state_dir

    print(revoke(state_dir(args.state_dir), args.node))
    return 0
