"""``mesh-llm plan MODEL``: what the mesh as it stands would do with a model, without loading it
(``serve/preview.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub: Any) -> None:
    p = sub.add_parser("plan", help="what the mesh would do with a model, without loading it",
                       description="Placement, memory per node, slots and context the mesh as it stands would "
                                   "give MODEL (the view of the node on --state-dir; this machine alone when none "
                                   "runs).")  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="a GGUF file or an installed catalog name")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the running node's state (default ~/.mesh-llm)")
    p.add_argument("--models-dir", type=Path, metavar="DIR", help="where models are (default ~/.models)")
    p.add_argument("--parallel", type=int, metavar="N", help="slots (default: as the node would pick)")
    p.add_argument("--ctx-size", type=int, metavar="N", help="context per slot (default: as the node would pick)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.paths import state_dir
    from meshllm.serve.preview import preview

    for line in preview(args.model, state_dir(args.state_dir), args.models_dir, args.parallel, args.ctx_size):
        print(line)
    return 0
