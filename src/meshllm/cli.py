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
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from meshllm import __version__, sockets
from meshllm.admin import cmd_admin, cmd_approve, cmd_direct, cmd_refuse, cmd_revoke, cmd_rotate, cmd_token
from meshllm.errors import UserError
from meshllm.llama.build import Binaries, BuildPlan
from meshllm.proto import token as tok
from meshllm.proto.reach import RELAY_RATE, RelayMode
from meshllm.serve.split.serving_flags import add_serving_flags, int_in, tuning_from

if TYPE_CHECKING:
    pass

console = Console(stderr=True, highlight=False, soft_wrap=True)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad value is one line (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parse_duration(text: str) -> float:
    """'1d', '12h', '30m', '45s' or plain seconds; more than zero."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([dhms]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 1d, 12h, 30m or seconds")
    seconds = float(m.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}[m.group(2)]
    if not 0 < seconds <= 10 * 365 * 86400:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be more than 0 and at most 10 years")
    return seconds


def admission(text: str) -> float:
    seconds = parse_duration(text)
    if seconds > tok.MAX_ADMIT_S:
        raise argparse.ArgumentTypeError(f"--admission {text!r}: at most {tok.MAX_ADMIT_S // 86400}d")
    return seconds


def relay_rate(text: str) -> float:
    """--relay-rate in MB/s (2**20 bytes), as bytes/s; 0: no cap."""
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= 1e6:
        raise argparse.ArgumentTypeError(f"--relay-rate {text!r}: a number of MB/s, 0 (no cap) to 1000000")
    return mb * 2**20




_int_in = int_in  # a whole number in a range, or one line naming the option (serve/split/serving_flags.py)


def tcp_port(text: str) -> int:
    return _int_in(text, 1, 65535, "a port")


def rpc_port(text: str) -> int:
    return _int_in(text, 1, 65534, "a port below 65535 (the next one is taken too)")


def udp_port_or_zero(text: str) -> int:
    return _int_in(text, 0, 65535, "a port (0: any free one)")


def positive_int(text: str) -> int:
    return _int_in(text, 1, 1 << 20, "the number")


def _scope(text: str) -> object:
    from meshllm.proto.token import Scope

    try:
        return Scope.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _events_n(text: str) -> int:
    return _int_in(text, 0, 50, "the number of events")


def draft_max(text: str) -> int:
    return _int_in(text, 1, 64, "--draft-max")


def gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not 0 < value < 1e6:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be more than 0 GB, got {text}")
    return value


def ram_gigabytes(text: str) -> float:
    """--max-ram: as --max-vram, and 0 (offer no RAM: the model stays on accelerators)."""
    return 0.0 if text.strip() in ("0", "0.0") else gigabytes(text)


def ip_address(text: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address (e.g. 0.0.0.0 or ::)") from None


def host_port(text: str) -> str:
    """HOST:PORT or [IPv6]:PORT with a port of 1-65535; a host name is resolved here, once (the mesh passes IP
    addresses only)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536 or " " in host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (port 1-65535)")
    if tok.ip_port(text):
        return text
    try:
        ip = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0][4][0]
    except (OSError, UnicodeError):
        raise argparse.ArgumentTypeError(f"cannot resolve {host!r} to an IP address") from None
    return sockets.host_port(str(ip), int(port))


def python_versions(text: str) -> tuple[str, ...]:
    out = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in out if not re.fullmatch(r"3\.(1[1-9]|[2-9][0-9])", v)]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give Python versions >= 3.11 like 3.11,3.12")
    return out


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def parse_name(text: str) -> str:
    from meshllm.proto.gossip import MAX_NAME

    if not text or len(text) > MAX_NAME or not text.isprintable():
        raise argparse.ArgumentTypeError(f"a node name is 1-{MAX_NAME} printable characters, got {text!r}")
    return text


def parse_split(text: str) -> list[float]:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --tensor-split {text!r}: use proportions like 1,1,2") from None
    if not parts or any(not 0 <= p < 1e6 for p in parts) or sum(parts) <= 0:
        raise argparse.ArgumentTypeError("--tensor-split needs non-negative proportions with a positive sum")
    return parts


def gather_tokens(args: argparse.Namespace) -> list[str]:
    """--join (repeatable), --join-file (repeatable), then $MESH_LLM_JOIN: tokens need not be on the command
    line, where other users of the machine could read them."""
    tokens = list(args.join or [])
    for path in args.join_file or []:
        try:
            tokens += Path(path).read_text().split()
        except OSError as e:
            raise UserError(f"--join-file {path}: {e.strerror}") from None
    env = os.environ.get("MESH_LLM_JOIN", "")
    tokens += [t for t in re.split(r"[\s,]+", env) if t]
    return tokens


def _member(state: Path | None) -> bool:
    """Whether this state dir holds a membership (a restart rejoins the members it knew, no token needed)."""
    from meshllm.paths import state_dir
    from meshllm.state import load_membership

    try:
        return load_membership(state_dir(state)) is not None
    except UserError:
        return False


def cmd_node(args: argparse.Namespace) -> int:
    from meshllm.serve.node import run_node
    from meshllm.serve.options import NodeOptions

    tokens = gather_tokens(args)
    tuning = tuning_from(args)
    lan = args.join_lan is not None  # a token comes with the approval: --join-lan stands for --join below
    if args.client and not tokens and not lan and not _member(args.state_dir):
        raise UserError("--client needs --join TOKEN (or --join-file / MESH_LLM_JOIN) the first time")
    if args.client and args.model is not None:
        raise UserError("--client serves no model: drop --model, or drop --client to serve it")
    auto_fetch = args.model == Path("auto")  # the model that needs this node most, fetched from the mesh
    if auto_fetch and not tokens and not lan and not _member(args.state_dir):
        raise UserError("--model auto serves a model of the mesh it joins: give --join TOKEN too")
    if auto_fetch and args.client:
        raise UserError("--client serves no model: drop --model auto, or drop --client")
    args.model = None if auto_fetch else args.model
    if not args.client and args.model is None and not tokens and not lan and not auto_fetch:
        raise UserError("give --model PATH (or --join TOKEN to serve the mesh's model, or --client)")
    auto = not args.client and args.model is None
    api_key = args.api_key or os.environ.get("MESH_LLM_API_KEY") or None
    if args.listen_all and not api_key:
        import secrets

        from meshllm.paths import state_dir
        from meshllm.state import save_api_key

        api_key = secrets.token_urlsafe(24)
        path = save_api_key(state_dir(args.state_dir), api_key)
        where = f"API key (also in {path}): {api_key}" if sys.stderr.isatty() else f"API key written to {path}"
        console.print(f"--listen-all: requests need 'Authorization: Bearer <key>'. {where}")
    bins = None if args.client else ensure_binaries(args.bin_dir)
    opts = NodeOptions(
        model=args.model, client=args.client, join=tokens, state_dir=args.state_dir, bind_host=args.bind_host,
        bind_port=args.bind_port, advertise=args.advertise or [], token_ttl_s=args.token_ttl,
        admission_s=args.admission,
        relay=args.relay, relay_mode=args.relay_mode, relay_rate=args.relay_rate, join_lan=args.join_lan,
        announce=args.announce, max_ram_gb=args.max_ram,
        max_vram_gb=args.max_vram, ctx_size=args.ctx_size, parallel=args.parallel, queue=args.queue,
        tuning=tuning, tensor_split=args.tensor_split, split_replicas=args.split_replicas, port=args.port,
        listen_all=args.listen_all, api_key=api_key, max_tokens=args.max_tokens, bins=bins, auto_model=auto,
        models_dir=args.models_dir,
        draft=args.draft, draft_max=args.draft_max, no_draft=args.no_draft, console_port=args.console,
        rpc_path=args.rpc_path, rpc_port=args.rpc_port, name=args.name or "", share=args.share == "on",
        fetch_all=args.fetch == "all", auto_fetch=auto_fetch,
    )  # fmt: skip
    from meshllm.machine import LogFile, registered
    from meshllm.paths import state_dir as node_state_dir
    from meshllm.serve.report.terminal import terminal_for_node

    state = node_state_dir(args.state_dir)
    model = str(args.model or ("lite client" if args.client else ""))
    with registered(state, f"http://127.0.0.1:{args.port}/v1", model):  # `mesh-llm ps`, `stop`, `logs`
        return run_node(opts, terminal_for_node(getattr(args, "verbose", False), LogFile(state)))


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
        cmd_build(argparse.Namespace(stock=False, llama_src=None, backend=None, bin_dir=None, jobs=None,
                                     print_dir=False, cpu_level=None))  # fmt: skip
    return b.find_binaries()


def _add_build_args(p: argparse.ArgumentParser) -> None:
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


def _build(plan: BuildPlan, replan: Callable[[str], BuildPlan], jobs: int | None) -> BuildPlan:
    """Build ``plan`` with a progress bar; it must pass its self-test (retried once with safer CPU flags)."""
    from meshllm.llama import build as b
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
        f"{b.describe_cpu_flags(done.cmake_flags)}) in {result.seconds:.0f} s: {done.bin_dir}"
    )
    return done


def cmd_build(args: argparse.Namespace) -> int:
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
    _build(plan, replan, args.jobs)
    return 0


def cmd_bundle(args: argparse.Namespace) -> int:
    from meshllm.bundle import check_output, make_bundle
    from meshllm.llama import build as b

    def replan(level: str) -> BuildPlan:
        return b.plan_build(backend=args.backend, cpu_level=level)

    out = check_output(args.out)
    plan = _build(replan("portable"), replan, args.jobs)
    make_bundle(out, plan.binaries(), plan, pythons=args.python, say=console.print)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from rich.table import Table

    from meshllm.models import catalog
    from meshllm.models.download import download_entry, download_file, installed
    from meshllm.paths import models_dir

    where = models_dir(args.models_dir)
    if args.check:
        from meshllm.models.download import check_catalog

        out = Console(highlight=False)
        bad = check_catalog(lambda line: out.print(line, markup=False))
        out.print(f"{bad} of the catalog's entries differ from the hub" if bad else "the catalog matches the hub")
        return 1 if bad else 0
    if not args.name:
        from rich import box

        out = Console(highlight=False)
        # the names are what users type: never cut, at any width (the aliases fold instead)
        t = Table(title=f"models ({where})", box=box.SIMPLE_HEAD, pad_edge=False)
        t.add_column("name", no_wrap=True)
        t.add_column("GB", justify="right", no_wrap=True)
        t.add_column("needs", justify="right", no_wrap=True)
        t.add_column("draft", no_wrap=True)
        t.add_column("have", no_wrap=True)
        longest = max((len(a) for e in catalog.CATALOG for a in e.aliases), default=4)
        t.add_column("also", min_width=longest)  # wraps between aliases, never inside one
        for e in catalog.CATALOG:
            have = "yes" if (e.pypi and _tiny_installed()) or installed(e.files[0], where) else ""
            t.add_row(e.name, f"{e.size_gb:.2f}", f"{e.memory_gb:.1f}", e.draft or "-", have, ", ".join(e.aliases))
        out.print(t)
        out.print("GB: the download; needs: about what serving it takes (+15 %). mesh-llm download NAME [--draft]")
        return 0
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


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    from rich.table import Table
    from rich.text import Text

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
    out = Console(highlight=False)
    plan = st.get("plan") or {}
    # a lite client elects no host of its own: the host is whoever says so
    host = st.get("host") or next((p["node"] for p in st["peers"] if p["role"] == "host"), "") or ""
    models = [m for m in st.get("models") or [] if isinstance(m, dict)]
    if len(models) > 1:  # [fleet] each model has its own host
        host = ", ".join(f"{str(m['host'] or 'none')[:8]} ({m['name']})" for m in models)
        out.print(f"node {st['node'][:8]} ({st['role']}) in mesh {st['mesh'][:8]} — hosts {host}", soft_wrap=True)
    else:
        out.print(f"node {st['node'][:8]} ({st['role']}) in mesh {st['mesh'][:8]} — host {host[:8] or 'none'}")
    served = ", ".join(st.get("served_models") or []) or "none yet"
    out.print(f"model: {served} — API {st.get('api', '?')}", soft_wrap=True)
    why = st.get("unavailable")
    if why:  # what /health and a request's 503 say
        out.print(f"[yellow]{why}[/]", soft_wrap=True)
    else:
        out.print(f"[green]{_state_text(str(st.get('state', '?')), str(st.get('why') or ''))}[/]")
    # fits 80 columns: a path's words go onto lines of their own, an address is never broken (IPv4:port: 21 chars)
    t = Table(box=None, pad_edge=False)
    for name, justify in (("node", "left"), ("role", "left"), ("state", "left"), ("memory", "right"),
                          ("layers", "left"), ("path", "left"), ("RTT ms", "right")):  # fmt: skip
        t.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("path", "state"),  # type: ignore[arg-type]
                     min_width=21 if name == "path" else None)  # fmt: skip
    order = {m["fingerprint"]: i for i, m in enumerate(models)}  # the table grouped by model, lite clients last
    for p in sorted(st["peers"], key=lambda p: order.get(p.get("model"), len(order))):
        layers = p.get("layers")
        span = f"{layers[0]}-{layers[1]}" if layers else ""
        if isinstance(plan, dict) and p["node"] == plan.get("host"):
            span = f"{span} + output" if span else "output"  # the host's share always has the output layer
        used = p.get("planned_bytes")  # what the plan puts there, of what the node offers
        share = f"{used / 1e9:.1f}/" if used else ""
        mem = f"{share}{p['capacity'] / 1e9:.1f} GB {p.get('device') or ''}".strip() if p["capacity"] else "-"
        ram_used = f"{p['planned_ram_bytes'] / 1e9:.1f}/" if p.get("planned_ram_bytes") else ""  # [big]
        mem += f"\n+ {ram_used}{p['ram'] / 1e9:.1f} GB RAM" if p.get("ram") and p["capacity"] else ""
        state = p["state"]  # one vocabulary, as every node computes it (proto/standing.py); the reason below
        name = str(p.get("name") or "")[:12]  # a second line under the id: the hostname or --name
        t.add_row(
            p["short"] + (f"\n{name}" if name else ""), p["role"], state, mem, span or "-",
            Text(p["path"] + (f"\nRPC {p['rpc_path']}" if p.get("rpc_path") else "")),  # "[v6]:port": not markup
            f"{p['rtt_ms']:.1f}" if p.get("rtt_ms") is not None else "-",
        )  # fmt: skip
    out.print(t)
    if len(models) > 1 or any(m.get("replicas") for m in models):
        for m in models:
            nodes = ", ".join(str(n)[:8] for n in m["nodes"])
            reps = ", ".join(str(n)[:8] for n in m.get("replicas") or [])
            reps = f"; replicas {reps}" if reps else ""  # [fleet] hosts of it beside the elected one
            out.print(f"  {m['name']}: host {str(m['host'] or 'none')[:8]} {m['state']}{reps}; nodes {nodes}",
                      markup=False)  # fmt: skip
    if st.get("dropped"):
        out.print(f"  dropped by the founder or an admin: {', '.join(map(str, st['dropped']))}", markup=False)
    r = st.get("reach") or {}
    if r.get("relay_server"):  # [lan] 5: what it forwards for others, and its cap per pair
        cap = f"at most {r['relay_rate'] / 2**20:g} MB/s per pair" if r.get("relay_rate") else "no cap per pair"
        out.print(f"  relaying for members: {r.get('relay_pairs', 0)} pairs lately, {r['relayed_bytes'] / 1e6:.1f} MB "
                  f"forwarded, {cap} ({r.get('relay_capped', 0)} packets over it dropped)", markup=False)  # fmt: skip
    for p in st["peers"]:
        if p.get("why"):
            out.print(f"  {p['short']}: {_state_text(p['state'], p['why'])}", markup=False)
        if isinstance(p.get("held"), list):  # fetched only its layers (--fetch layers): it never hosts
            held = ", ".join(f"{f}-{f + n - 1}" for f, n in p["held"]) or "no layer yet"
            out.print(f"  {p['short']}: a partial copy of the model, holding layers {held}", markup=False)
    mt, tt = st.get("mesh_tokens"), st.get("ttft_s")
    if isinstance(mt, dict):
        host = f" (host {mt['host']})" if mt.get("host") else ""
        out.print(f"mesh: {mt['generated']} tokens generated, {mt['prompt']} prompt tokens{host}; "
                  f"{mt.get('rate', 0):.1f} tok/s now")  # fmt: skip
    fetch = st.get("fetch")
    if isinstance(fetch, dict):
        out.print(f"fetching {fetch['name']} from {fetch['sources']} peer{'s' if fetch['sources'] != 1 else ''}: "
                  f"{fetch['percent']}%, "
                  f"{fetch['mb_per_s']} MB/s")  # fmt: skip
    flight = st.get("in_flight")
    if flight:
        out.print(f"in flight here: {flight} request{'s' if flight != 1 else ''}")
    sl = st.get("slots")
    if isinstance(sl, dict) and sl.get("total"):
        out.print(f"slots: {sl['busy']} of {sl['total']} busy, {sl['queued']} waiting; "
                  f"{sl['ctx']} tokens of context each")  # fmt: skip
    mtt = st.get("mesh_ttft_s")
    if isinstance(mtt, dict):
        out.print(f"first token: {mtt['avg'] * 1000:.0f} ms on average over the mesh's {mtt['count']} requests")
    if isinstance(tt, dict):
        out.print(f"first token via this node: {tt['last'] * 1000:.0f} ms last, median <= {tt['p50'] * 1000:.0f} ms "
                  f"({tt['count']} requests)")  # fmt: skip
    for ev in (st.get("events") or [])[-args.events :] if args.events else []:
        out.print(f"{time.strftime('%H:%M:%S', time.localtime(ev['t']))} {ev['text']}", markup=False)
    return 0


def _state_text(state: str, why: str) -> str:
    from meshllm.proto.standing import Standing, State

    try:
        return Standing(State(state), why).text()
    except ValueError:  # a status written by another version
        return f"{state}: {why}" if why else state


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mesh-llm", description="Run one LLM across several machines.")
    p.add_argument("--version", action="version", version=f"mesh-llm {__version__}")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML file of flags and per-model options (default $MESH_LLM_CONFIG, else "
                        "~/.config/mesh-llm/config.toml where it exists); flags given here win")  # fmt: skip
    p.add_argument(
        "--model", type=Path, metavar="MODEL",
        help="a GGUF file (first part of a split model), a catalog name (`mesh-llm download` lists them, e.g. "
        "gemma3-270m, 32b), a Hugging Face org/repo/file.gguf, an https:// URL, or auto (with --join: the mesh's "
        "model that needs this node most, fetched from its members)",
    )  # fmt: skip
    p.add_argument("--client", action="store_true", help="lite client: no model, no GPU")
    p.add_argument("--join", type=nonempty, action="append", metavar="TOKEN", help="invite token (repeatable)")
    p.add_argument("--join-lan", nargs="?", const="", metavar="MESH",
                   help="find a mesh announced on this LAN (MESH: its id, or the announcing node's id or name, when "
                        "there are several) and ask to join; a member there lets this node in with `mesh-llm approve`")
    p.add_argument("--no-announce", dest="announce", action="store_false",
                   help="the founder (or an admin) does not announce its mesh on the LAN (mDNS)")  # fmt: skip
    p.add_argument("--join-file", action="append", metavar="PATH", help="file holding invite token(s)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="node state (default $MESH_LLM_HOME or ~/.mesh-llm)")
    p.add_argument("--bind-host", type=ip_address, default="0.0.0.0",
                   help="UDP address to bind (default all, IPv4 and IPv6)")
    p.add_argument("--bind-port", type=udp_port_or_zero, default=0, help="UDP port for the mesh (default ephemeral)")
    p.add_argument(
        "--advertise", type=host_port, action="append", metavar="HOST:PORT", help="address peers should dial"
    )
    p.add_argument(
        "--relay", type=host_port, metavar="HOST:PORT", help="relay through this member when a peer is unreachable"
    )
    p.add_argument(
        "--relay-server",
        dest="relay_mode",
        action="store_const",
        const=RelayMode.ON,
        default=RelayMode.AUTO,
        help="relay datagrams for members (default: only when this node is publicly reachable)",
    )
    p.add_argument(
        "--no-relay-server",
        dest="relay_mode",
        action="store_const",
        const=RelayMode.OFF,
        help="never relay for other members",
    )
    p.add_argument("--relay-rate", type=relay_rate, default=RELAY_RATE, metavar="MB_PER_S",
                   help=f"when relaying, forward at most this many MB/s per pair of members (default "
                        f"{RELAY_RATE / 2**20:g}; 0: no cap)")  # fmt: skip
    p.add_argument("--token-ttl", type=parse_duration, default=86400.0, metavar="DURATION", help="default 1d")
    p.add_argument("--admission", type=admission, default=tok.ADMIT_S, metavar="DURATION",
                   help="how long a member this node admits (or renews) stays in unless renewed; members in good "
                        f"standing renew themselves at half time (default {tok.ADMIT_S // 86400}d, at most "
                        f"{tok.MAX_ADMIT_S // 86400}d)")  # fmt: skip
    p.add_argument("--max-vram", type=gigabytes, metavar="GB", help="cap the memory this node offers")
    p.add_argument("--max-ram", type=ram_gigabytes, metavar="GB",
                   help="cap the RAM this node offers besides, for a MoE model's routed experts when the mesh's "
                        "accelerator memory is short (default: three quarters of its RAM; 0: none)")  # fmt: skip
    p.add_argument("--tensor-split", type=parse_split, metavar="P,P,...", help="override the split plan")
    p.add_argument("--split-replicas", action=argparse.BooleanOptionalAction, default=True,
                   help="let the nodes the host's plan leaves out, which hold the model only together, serve it as a "
                        "second split (a replica that is a split; default on)")  # fmt: skip
    p.add_argument("--name", type=parse_name, metavar="NAME", help="how other nodes show this one (default: hostname)")
    p.add_argument("--port", type=tcp_port, default=9337, help="API port (default 9337)")
    p.add_argument("--listen-all", action="store_true", help="API on all interfaces (then an API key is required)")
    p.add_argument("--api-key", type=nonempty, metavar="KEY", help="require this API key (or $MESH_LLM_API_KEY)")
    p.add_argument("--max-tokens", type=positive_int, metavar="N",
                   help="the most tokens one request may generate, on the API and the console (a request asking for "
                   "more, or not saying, gets N); default: no cap, 4096 for one not saying")  # fmt: skip
    p.add_argument("--bin-dir", type=Path, metavar="DIR", help="your own ggml-rpc-server and llama-server")
    p.add_argument("--console", nargs="?", type=tcp_port, const=3131, metavar="PORT",
                   help="web console on 127.0.0.1 (default port 3131)")  # fmt: skip
    p.add_argument("--draft", type=nonempty, metavar="PATH|NAME", help="draft model for speculative decoding")
    p.add_argument("--draft-max", type=draft_max, default=8, metavar="N", help="tokens drafted per step (default 8)")
    p.add_argument("--no-draft", action="store_true", help="no draft, not even the catalog's pairing")
    p.add_argument(
        "--share", choices=("on", "off"), default="on",
        help="send this node's model file to members that fetch it instead of downloading it (default on)",
    )
    p.add_argument(
        "--fetch", choices=("layers", "all"), default="layers",
        help="a --model this machine lacks, fetched from the mesh's members: only the layers the plan gives this "
        "worker (default; such a node is never elected host) or the whole file",
    )  # fmt: skip
    p.add_argument(
        "--rpc-path", choices=("auto", "tunnel"), default="auto",
        help="how a host reaches its workers' rpc-servers: auto (direct TCP + TLS 1.3 where reachable, else the QUIC "
        "tunnel; workers open a TLS port on all interfaces) or tunnel (always the tunnel, no extra port)",
    )  # fmt: skip
    p.add_argument(
        "--rpc-port", type=rpc_port, metavar="PORT",
        help="this worker's TLS RPC port for the direct path, and PORT+1 for the links between workers (default: any "
             "free ones); open both between your machines",
    )  # fmt: skip
    p.add_argument(
        "--models-dir", type=Path, metavar="DIR", help="where models live (default $MESH_LLM_MODELS or ~/.models)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_serving_flags(p)
    p.set_defaults(func=cmd_node)
    sub = p.add_subparsers(dest="command")
    pb = sub.add_parser(
        "build",
        help="build (or find) the llama.cpp binaries",
        description="Build the pinned llama.cpp with mesh-llm's patches (or find a cached build).",
    )
    _add_build_args(pb)
    pb.set_defaults(func=cmd_build)
    pt = sub.add_parser("token", help="mint a new invite token (reads this node's state dir)",
                        description="Print a new invite token for the mesh this node belongs to.")  # fmt: skip
    pt.add_argument("--state-dir", type=Path, metavar="DIR", help="the node's state (default ~/.mesh-llm)")
    pt.add_argument("--ttl", type=parse_duration, default=86400.0, metavar="DURATION",
                    help="how long it admits new nodes, e.g. 30m, 12h, 7d (default 1d; 30d at most)")  # fmt: skip
    pt.add_argument("--scope", type=_scope, metavar="SCOPE",
                    help="what the new node may do: client (the API only), worker (serve layers, never host), host "
                    "(may be elected host). Default: this node's own scope, the widest it may give")  # fmt: skip
    pt.set_defaults(func=cmd_token)
    pa = sub.add_parser("approve", help="let in a node that asked to join from the LAN (--join-lan)",
                        description="Without NODE: the nodes waiting for approval at the running node (the founder or "
                        "an admin, which announces the mesh on the LAN). With NODE: an invite token of --scope for it, "
                        "which the running node hands it at its next knock.")  # fmt: skip
    pa.add_argument("node", nargs="?", metavar="NODE", help="its id as the list shows it (4 or more hex digits)")
    pa.add_argument("--scope", type=_scope, default=tok.Scope.WORKER, metavar="SCOPE",
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
    pr.add_argument("node", type=nonempty, help="the member's node id (8+ hex digits as `mesh-llm status` shows)")
    pr.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
    pr.set_defaults(func=cmd_revoke)
    pa = sub.add_parser("admin", help="let a member revoke others too (the founder only)",
                        description="Name a member admin: signed by this node (the mesh's founder), written to its "
                        "state dir, gossiped by the running node. An admin may `mesh-llm revoke` members, never the "
                        "founder or another admin; revoking the admin ends that.")  # fmt: skip
    pa.add_argument("node", type=nonempty, help="the member's node id (8+ hex digits as `mesh-llm status` shows)")
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
        pv.add_argument("name", type=nonempty, help="the model's name as /v1/models lists it (or a catalog name)")
        pv.add_argument("--state-dir", type=Path, metavar="DIR", help="this node's state (default ~/.mesh-llm)")
        pv.set_defaults(func=cmd_direct, serve=serve)
    pd = sub.add_parser(
        "download",
        help="list the model catalog, or download a model",
        description="Without a name: the catalog. With one: download it (and --draft, its draft).",
    )
    pd.add_argument("name", nargs="?", type=nonempty, help="catalog name (e.g. 32b, qwen3-32b)")
    pd.add_argument("--draft", action="store_true", help="also fetch its paired draft model")
    pd.add_argument("--models-dir", type=Path, metavar="DIR", help="where models go (default ~/.models)")
    pd.add_argument("--check", action="store_true", help="verify every catalog entry against the live hub")
    pd.add_argument("--join", type=nonempty, action="append", metavar="TOKEN",
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
        "--python", type=python_versions, default=("3.11", "3.12", "3.13"), metavar="3.X,...",
        help="Python versions to carry wheels for (default 3.11,3.12,3.13, plus this one)",
    )  # fmt: skip
    pk.add_argument("--backend", choices=("cpu", "cuda", "metal", "vulkan"), help="default: as mesh-llm build")
    pk.add_argument("-j", "--jobs", type=positive_int, help="parallel compile jobs (default: all cores)")
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
    ps.add_argument("--port", type=tcp_port, default=9337, help="the node's API port (default 9337)")
    ps.add_argument("--api-key", default=os.environ.get("MESH_LLM_API_KEY"),
                    help="the node's API key, if it runs with --listen-all (or $MESH_LLM_API_KEY)")  # fmt: skip
    ps.add_argument(
        "--state-dir", type=Path, metavar="DIR", help="read the status the node last wrote into DIR instead"
    )
    ps.add_argument("--json", action="store_true", help="the raw /mesh/status JSON")
    ps.add_argument("--events", type=_events_n, default=5, metavar="N",
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
