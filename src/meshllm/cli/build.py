"""``mesh-llm build [--stock] [--backend B] [--cpu LEVEL]``: the llama.cpp binaries as the command line gets them —
the cached build found, or a build now with a progress bar on the terminal, self-tested (retried once with safer CPU
flags), and the line that says what was built (``llama/build.py`` does the work). ``ensure_binaries`` is the same for
a node about to start (``cli/node.py``): the one place a node's start may build."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from meshllm.cli import console
from meshllm.cli.args import positive_int
from meshllm.errors import UserError
from meshllm.llama.build import Binaries, BuildPlan
from meshllm.llama.hardware import describe_cpu_flags


def ensure_binaries(bin_dir: Path | None) -> Binaries:
    """The patched binaries: the user's (--bin-dir), the cached build, or a build now (with progress)."""
    from meshllm.llama import build as b

    if bin_dir is not None:
        return b.user_binaries(bin_dir)
    if os.environ.get("MESH_LLM_BIN_DIR") or b.bundled_binaries():
        return b.find_binaries()
    plan = b.plan_build()
    if not plan.is_built():
        console.print("llama.cpp is not built yet: building it now (about 10 minutes on 2 cores, once)")
        run(argparse.Namespace(stock=False, llama_src=None, backend=None, bin_dir=None, jobs=None,
                                         print_dir=False, cpu_level=None))  # fmt: skip
    return b.find_binaries()


def build_shown(plan: BuildPlan, replan: Callable[[str], BuildPlan], jobs: int | None) -> BuildPlan:
    """Build ``plan`` with a progress bar; it must pass its self-test (retried once with safer CPU flags)."""
    from meshllm.llama.selftest import build_verified

    if plan.is_built():
        return plan
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task(f"{plan.flavour} build", total=None)

        def on_progress(step: str, done: int, total: int) -> None:
            progress.update(task, description=f"{plan.flavour}: {step}", completed=done, total=total)

        result = build_verified(plan, replan, jobs=jobs, say=lambda m: progress.console.print(m), progress=on_progress)
    done = result.plan
    console.print(
        f"[green]built[/] {done.flavour} {done.backend} build {done.key} ({done.cpu_level} CPU: "
        f"{describe_cpu_flags(done.cmake_flags)}) in {result.seconds:.0f} s: {done.bin_dir}"
    )
    return done


def run(args: argparse.Namespace) -> int:
    """``mesh-llm build``: the binaries found, already built, or built now with a progress bar."""
    from meshllm.llama import build as b

    if args.bin_dir is not None:
        bins = b.user_binaries(args.bin_dir)
        console.print(f"using {bins.describe()}")
        if args.print_dir:
            print(bins.rpc_server.parent)
        return 0

    def replan(level: str | None) -> BuildPlan:
        return b.plan_build(stock=args.stock, llama_src=args.llama_src, backend=args.backend, cpu_level=level)

    plan = replan(args.cpu_level)
    if args.print_dir:
        if not plan.is_built():
            raise UserError(f"not built yet: run mesh-llm build{' --stock' if args.stock else ''}")
        print(plan.bin_dir)
        return 0
    if plan.is_built():
        console.print(
            f"[green]up to date[/]: {plan.flavour} {plan.backend} build {plan.key} ({plan.cpu_level} CPU) "
            f"in {plan.bin_dir}"
        )
        return 0
    build_shown(plan, replan, args.jobs)
    return 0


def add(sub: Any) -> None:
    p = sub.add_parser(
        "build",
        help="build (or find) the llama.cpp binaries",
        description="Build the pinned llama.cpp with mesh-llm's patches (or find a cached build).",
    )
    p.add_argument("--stock", action="store_true", help="build upstream llama.cpp without our patches")
    p.add_argument("--llama-src", type=Path, metavar="DIR", help="build this llama.cpp tree instead of the pinned one")
    p.add_argument(
        "--backend", choices=("cpu", "cuda", "metal", "vulkan"),
        help="default: CUDA if a CUDA toolkit and a GPU, Metal on macOS, else CPU; vulkan: any Vulkan GPU (AMD, Intel)"
    )
    p.add_argument("--bin-dir", type=Path, metavar="DIR", help="use your own ggml-rpc-server and llama-server from DIR")
    p.add_argument(
        "--cpu", choices=("native", "portable", "generic"), dest="cpu_level",
        help="CPU instructions to compile for: native (this CPU's, the default), portable (x86-64-v3: any x86 CPU "
        "since 2013), generic (the compiler's baseline)",
    )  # fmt: skip
    p.add_argument("-j", "--jobs", type=positive_int, help="parallel compile jobs (default: all cores)")
    p.add_argument("--print-dir", action="store_true", help="print the directory holding the binaries and exit")
    p.set_defaults(func=run)
