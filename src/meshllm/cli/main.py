"""The `mesh-llm` command: its parser put together from one module per command (``cli/*.py``), the config file
under the node's own flags, a mistyped option named with its nearest match, and one line for any error."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from meshllm import __version__
from meshllm.cli import (
    admin,
    approve,
    build,
    bundle,
    console,
    doctor,
    download,
    drop,
    logs,
    node,
    plan,
    ps,
    refuse,
    revoke,
    rotate,
    serve,
    service,
    status,
    stop,
    token,
)
from meshllm.errors import UserError
from meshllm.serve.split.serving_flags import add_serving_flags

COMMANDS = (build, token, approve, refuse, revoke, admin, rotate, serve, drop, download, bundle, ps, stop, logs,
            service, doctor, plan, status)  # fmt: skip  # in the order `mesh-llm --help` lists them


class Parser(argparse.ArgumentParser):
    """argparse, but a bad value is one line (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mesh-llm", description="Run one LLM across several machines.")
    p.add_argument("--version", action="version", version=f"mesh-llm {__version__}")
    node.add_node_args(p)
    add_serving_flags(p)
    p.set_defaults(func=node.run)
    sub = p.add_subparsers(dest="command")
    for command in COMMANDS:
        command.add(sub)
    return p


def _subcommand_index(parser: argparse.ArgumentParser, argv: list[str]) -> int | None:
    """Where the subcommand's name stands in ``argv`` (None: none, the node's own command line)."""
    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    names = set(subs.choices) if subs is not None else set()
    valued = {o for a in parser._actions if a.nargs != 0 and not isinstance(a, argparse._SubParsersAction)
              for o in a.option_strings}  # fmt: skip
    skip = False
    for i, word in enumerate(argv):
        if skip:  # the value of an option (`--name status` names a node "status")
            skip = False
        elif word in names:
            return i
        elif word == "--":
            break
        else:
            skip = word in valued
    return None


def _options_before_subcommand(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The words before a subcommand's name (`mesh-llm --port 9437 status`): the node's options, which the
    subcommand would silently ignore. Empty when no subcommand is named or nothing precedes it."""
    i = _subcommand_index(parser, argv)
    if i is None:
        return []
    return argv[:i] if any(w not in ("-v", "--verbose") for w in argv[:i]) else []


def _parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The node's command line over its config file (machine/config.py); a subcommand's as it is."""
    from meshllm.machine import config

    path, _ = config.config_path(argv)
    if path is None or _subcommand_index(parser, argv) is not None:
        return parser.parse_args(argv)
    try:
        data = config.load(path)
        config.apply(parser, path, data)
        args = parser.parse_args(argv)
        if getattr(args, "model", None) is not None:
            config.apply(parser, path, data, str(args.model))  # its [models."NAME"] table, under the flags
            args = parser.parse_args(argv)
    except UserError as e:
        parser.exit(2, f"mesh-llm: error: {e}\n")
    return args


def unknown_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first ``--word`` no parser here knows, with the nearest one it may be a typo of (argparse
    itself would read `--modle gemma3-270m` as a subcommand named gemma3-270m); None when every one is known."""
    import difflib

    known: set[str] = set()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            known.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    for word in argv:
        if word == "--":
            break
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            near = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.7)
            return f"unknown option {flag}" + (f" (did you mean {near[0]}?)" if near else "")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    if (unknown := unknown_option(parser, argv)) is not None:
        parser.error(unknown)
    before = _options_before_subcommand(parser, argv)
    if before:
        parser.error(f"{before[0]} comes before the subcommand {argv[len(before)]!r}, where it means nothing: write "
                     f"`mesh-llm {argv[len(before)]} {' '.join(before)} ...`")  # fmt: skip
    args = _parse_with_config(parser, argv)
    func = args.func
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for chatty in ("quic", "httpx2", "httpx", "huggingface_hub"):  # a line per HTTP request is not news
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        rc: int = func(args)
        return rc
    except UserError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    except Exception as e:  # a bug of ours: one line, the traceback only with -v
        if getattr(args, "verbose", False):
            raise
        console.print(
            f"[red]internal error:[/] {type(e).__name__}: {e} (rerun with -v for the traceback and report it)"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
