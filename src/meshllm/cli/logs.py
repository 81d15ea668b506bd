"""``mesh-llm logs [-n N] [-f]``: what a node has printed, from its state dir's node.log
(``machine/registry.logs``)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("logs", help="what a node has printed (its state dir's node.log)",
                       description="The last lines of the node's log; -f follows it.")  # fmt: skip
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    p.add_argument("-n", "--lines", type=int, default=50, metavar="N", help="how many lines (default 50)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines while the node runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.registry import logs
    from meshllm.paths import state_dir

    with contextlib.suppress(KeyboardInterrupt):
        logs(state_dir(args.state_dir), args.lines, args.follow)
    return 0
