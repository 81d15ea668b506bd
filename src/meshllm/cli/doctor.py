"""``mesh-llm doctor``: what this machine has for a node, one line per check with its fix (``machine/doctor.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check what this machine has for a node, one line per check with its fix",
                       description="Python, build tools, llama.cpp's build, GPU and toolkit, the API port, the "
                                   "state dir, disk for models, and the members a running node reaches.")  # fmt: skip
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    p.add_argument("--port", type=int, default=9337, help="the API port the node would use (default 9337)")
    p.add_argument("--models-dir", type=Path, metavar="DIR", help="where models go (default ~/.models)")
    p.add_argument("--model", metavar="FILE", help="a model file: is there disk for a copy of it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.machine.doctor import FAIL, checks
    from meshllm.paths import models_dir, state_dir

    need = Path(args.model).stat().st_size if args.model and Path(args.model).is_file() else None
    done = checks(state_dir(args.state_dir), args.port, models_dir(args.models_dir), need)
    for c in done:
        print(c.line())
    return 1 if any(c.result == FAIL for c in done) else 0
