"""``mesh-llm bundle [OUT.tar.gz]``: the patched binaries of a portable build (built here first where needed), every
wheel and an install script, for machines with no compiler and no package index (``llama/bundle.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshllm.cli import args as a
from meshllm.cli import console
from meshllm.llama.build import BuildPlan


def add(sub: Any) -> None:
    pk = sub.add_parser(
        "bundle",
        help="pack binaries, wheels and an install script for machines with no compiler",
        description="A tarball that installs mesh-llm where there is no compiler and no index.",
    )
    pk.add_argument("out", nargs="?", type=Path, default=Path("mesh-llm-bundle.tar.gz"), metavar="OUT.tar.gz")
    pk.add_argument(
        "--python", type=a.python_versions, default=("3.11", "3.12", "3.13"), metavar="3.X,...",
        help="Python versions to carry wheels for (default 3.11,3.12,3.13, plus this one)",
    )  # fmt: skip
    pk.add_argument("--backend", choices=("cpu", "cuda", "metal", "vulkan"), help="default: as mesh-llm build")
    pk.add_argument("-j", "--jobs", type=a.positive_int, help="parallel compile jobs (default: all cores)")
    pk.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.cli.build import build_shown
    from meshllm.llama import build as b
    from meshllm.llama.bundle import check_output, make_bundle

    def replan(level: str) -> BuildPlan:
        return b.plan_build(backend=args.backend, cpu_level=level)

    out = check_output(args.out)
    plan = build_shown(replan("portable"), replan, args.jobs)
    make_bundle(out, plan.binaries(), plan, pythons=args.python, say=console.print)
    return 0
