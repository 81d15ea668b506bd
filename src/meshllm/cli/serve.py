"""``mesh-llm serve NAME`` (the founder or an admin): ask the whole mesh to serve a model (again); the newest
word about a model counts (``machine/words.direct``). ``drop.py`` is the same word, the other way."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshllm.cli import args as a


def add(sub: Any) -> None:
    add_word(sub, "serve", "serve a model (again)", serve=True)


def add_word(sub: Any, verb: str, what: str, serve: bool) -> None:
    """``mesh-llm serve`` or ``mesh-llm drop``: one signed word about a model, either way."""
    p = sub.add_parser(verb, help=f"ask the mesh to {what} (the founder or an admin)",
                       description=f"Ask the whole mesh to {what}: signed by this node (the founder or an admin), "
                       "written to its state dir, gossiped by the running node; the newest word about a model "
                       "counts.")  # fmt: skip
    p.add_argument("name", type=a.nonempty, help="the model's name as /v1/models lists it (or a catalog name)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
    p.set_defaults(func=run, serve=serve)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import direct
    from meshllm.paths import state_dir

    print(direct(state_dir(args.state_dir), args.name, serve=args.serve))
    return 0
