"""``mesh-llm refuse NODE``: turn away a node that knocked from the LAN; its next knock is answered "refused"
(``serve/life/lan.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("refuse", help="turn away a node that asked to join from the LAN (--join-lan)",
                       description="Its next knock is answered 'refused': it stops asking and says so.")
    p.add_argument("node", metavar="NODE", help="its id as `mesh-llm approve` lists it (4 or more hex digits)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import member_state
    from meshllm.paths import state_dir
    from meshllm.serve.life.lan import refuse

    sd = state_dir(args.state_dir)
    member_state(sd)
    print(refuse(sd, args.node))
    return 0
