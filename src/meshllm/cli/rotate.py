"""``mesh-llm rotate`` (the founder only): a new admission secret; tokens minted before stop admitting, members stay
(``machine/words.rotate``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("rotate", help="a new admission secret: old tokens stop working (the founder only)",
                       description="Rotate the mesh's admission secret: every token minted before stops admitting "
                       "new nodes; members stay members and get the new secret from the running founder.")  # fmt: skip
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the founder's state (default ~/.mesh-llm)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.words import rotate
    from meshllm.paths import state_dir

    print(rotate(state_dir(args.state_dir)))
    return 0
