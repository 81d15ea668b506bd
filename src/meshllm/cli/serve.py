"""``mesh-llm serve NAME`` (the founder or an admin): ask the whole mesh to serve a model (again); the newest
word about a model counts (``machine/words.direct``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshllm.cli import args as a


def add(sub: Any) -> None:
    p = sub.add_parser("serve", help="ask the mesh to serve a model (again) (the founder or an admin)",
                       description="Ask the whole mesh to serve a model (again): signed by this node "
                       "(the founder or an admin), written to its state dir, gossiped by the running node; the "
                       "newest word about a model counts.")  # fmt: skip
    p.add_argument("name", type=a.nonempty, help="the model's name as /v1/models lists it (or a catalog name)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import direct
    from meshllm.paths import state_dir

    print(direct(state_dir(args.state_dir), args.name, serve=True))
    return 0
