"""``mesh-llm service install [NODE FLAGS] | remove``: a node as a systemd user service (``machine/service.py``)."""

from __future__ import annotations

import argparse
from typing import Any

from meshllm.errors import UserError
from meshllm.machine.service import UNIT


def add(sub: Any) -> None:
    p = sub.add_parser("service", help="run a node as a systemd user service (restarted on failure, at boot)",
                       description="install: a systemd user unit running mesh-llm with the flags after it; "
                                   "remove: take it away.")  # fmt: skip
    p.add_argument("action", choices=("install", "remove"))
    p.add_argument("--unit", default=UNIT, metavar="NAME", help=f"the unit's name (default {UNIT})")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="the node's flags (install), e.g. --model gemma3-270m")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.service import install, remove

    flags, unit = [f for f in args.flags if f != "--"], args.unit
    if "--unit" in flags:  # after the action, argparse leaves it among the node's flags
        i = flags.index("--unit")
        if i + 1 >= len(flags):
            raise UserError("--unit needs a name")
        unit = flags[i + 1]
        del flags[i : i + 2]
    print(install(flags, unit) if args.action == "install" else remove(unit))
    return 0
