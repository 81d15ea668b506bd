"""Command line: argument parsing and terminal output only. The work happens in the modules it calls.

mesh-llm --model x.gguf                   serve (solo, or host of a new mesh)
mesh-llm build [--stock]                  build the patched (or stock) llama.cpp binaries
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from meshllm import __version__
from meshllm.errors import UserError

console = Console(stderr=True, highlight=False, soft_wrap=True)

SUBCOMMANDS = ("build", "serve")


def _add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stock", action="store_true", help="build upstream llama.cpp without our patches")
    p.add_argument("--llama-src", type=Path, metavar="DIR", help="build this llama.cpp tree instead of the pinned one")
    p.add_argument(
        "--backend", choices=("cpu", "cuda", "metal"), help="default: CUDA if nvcc and a GPU, Metal on macOS, else CPU"
    )
    p.add_argument("--bin-dir", type=Path, metavar="DIR", help="use your own ggml-rpc-server and llama-server from DIR")
    p.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    p.add_argument("--print-dir", action="store_true", help="print the directory holding the binaries and exit")


def cmd_build(args: argparse.Namespace) -> int:
    from meshllm.llama import build as b

    if args.bin_dir is not None:
        bins = b.user_binaries(args.bin_dir)
        console.print(f"using {bins.describe()}")
        if args.print_dir:
            print(bins.rpc_server.parent)
        return 0
    plan = b.plan_build(stock=args.stock, llama_src=args.llama_src, backend=args.backend)
    if args.print_dir:
        if not plan.is_built():
            raise UserError(f"not built yet: run mesh-llm build{' --stock' if args.stock else ''}")
        print(plan.bin_dir)
        return 0
    if plan.is_built():
        console.print(f"[green]up to date[/]: {plan.flavour} {plan.backend} build {plan.key} in {plan.bin_dir}")
        return 0
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task(f"{plan.flavour} build", total=None)

        def on_progress(step: str, done: int, total: int) -> None:
            progress.update(task, description=f"{plan.flavour}: {step}", completed=done, total=total)

        result = b.build(plan, jobs=args.jobs, say=lambda m: progress.console.print(m), progress=on_progress)
    console.print(
        f"[green]built[/] {plan.flavour} {plan.backend} build {plan.key} in {result.seconds:.0f} s: {plan.bin_dir}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh-llm", description="Run one LLM across several machines.")
    p.add_argument("--version", action="version", version=f"mesh-llm {__version__}")
    sub = p.add_subparsers(dest="command")
    pb = sub.add_parser("build", help="build (or find) the llama.cpp binaries")
    _add_build_args(pb)
    pb.set_defaults(func=cmd_build)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        rc: int = func(args)
        return rc
    except UserError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
