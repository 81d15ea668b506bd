"""What a node is told at start: its options (from the command line), and the inputs checked before anything
listens — the --join tokens, the memory it offers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from meshllm.errors import UserError
from meshllm.llama.build import Binaries
from meshllm.llama.hardware import gpu_visible
from meshllm.llama.processes import Tuning, device_listing
from meshllm.proto import token as tok
from meshllm.proto.capacity import Offer, offer, parse_devices
from meshllm.proto.reach import RELAY_RATE, RelayMode
from meshllm.proto.record import MAX_NAME
from meshllm.serve.split.serving_flags import tuning_from


@dataclass
class NodeOptions:
    model: Path | None = None
    client: bool = False
    join: list[str] = field(default_factory=list)
    join_lan: str | None = None  # --join-lan [MESH]: find a mesh on the LAN and ask to join ("": the only one)
    announce: bool = True  # --no-announce: the founder (or an admin) does not announce its mesh on the LAN
    state_dir: Path | None = None
    bind_host: str = "0.0.0.0"
    bind_port: int = 0
    advertise: list[str] = field(default_factory=list)
    relay: str | None = None  # --relay HOST:PORT
    relay_mode: RelayMode = RelayMode.AUTO
    relay_rate: float = RELAY_RATE  # --relay-rate: what this node forwards per pair of members when it relays, bytes/s
    token_ttl_s: float = 86400.0
    admission_s: float = tok.ADMIT_S  # --admission: how long the admissions this node signs hold unless renewed
    max_vram_gb: float | None = None
    max_ram_gb: float | None = None  # --max-ram: RAM offered for routed experts
    ctx_size: int | None = None  # each slot's context (None: auto, sizing.size)
    parallel: int | None = None  # llama-server's slots (None: auto)
    queue: int | None = None  # --queue: how many requests may wait for a slot (None: proto.slots.default_queue)
    tuning: Tuning = field(default_factory=Tuning)  # llama-server's serving options (the host applies them)
    tensor_split: list[float] | None = None
    split_replicas: bool = True  # --split-replicas: nodes the host's plan leaves out may serve a second split
    port: int = 9337
    listen_all: bool = False
    api_key: str | None = None
    max_tokens: int | None = None  # --max-tokens: the most one request may generate (API and console)
    bins: Binaries | None = None  # None: a lite client
    console_port: int | None = None  # --console [PORT]
    draft: str | None = None  # --draft PATH|NAME
    draft_max: int = 8
    no_draft: bool = False
    auto_model: bool = False  # joined without --model: serve the mesh's model if we have a copy
    rpc_path: str = "auto"  # --rpc-path: "auto" (direct TLS where reachable, else tunnel) or "tunnel"
    rpc_port: int | None = None  # --rpc-port: the TLS listener's port (None: any free one)
    models_dir: Path | None = None
    name: str = ""  # --name: how people see this node (default: the hostname)
    share: bool = True  # --share: serve our model file to members that fetch it
    fetch_all: bool = False  # --fetch all: a model fetched from the mesh comes whole (else only our layers)
    auto_fetch: bool = False  # --model auto: serve the model that needs this node most, fetched if not here


def default_name() -> str:
    """This machine's hostname, as far as a node name may go (gossip.MAX_NAME, printable)."""
    name = "".join(c for c in socket.gethostname() if c.isprintable())
    return name[:MAX_NAME]


async def measure_offer(bins: Binaries | None, max_gb: float | None, max_ram_gb: float | None = None) -> Offer:
    """Measured once at start: the free memory of the accelerator llama.cpp sees (a CPU node: its RAM), capped by
    ``--max-vram``."""
    listing = await asyncio.to_thread(device_listing, bins) if bins is not None else ""
    got = offer(parse_devices(listing), psutil.virtual_memory().total, max_gb, max_ram_gb)
    if bins is not None and got.device == "cpu" and await asyncio.to_thread(gpu_visible):
        logging.getLogger("meshllm").warning(
            "this node runs on the CPU though a GPU is visible: its llama.cpp build is the CPU's (%s) — install "
            "the CUDA toolkit, then `mesh-llm build` (it finds it in /usr/local/cuda too)", bins.describe())
    return got


def parse_tokens(texts: list[str], now: float, mesh_id: bytes | None) -> list[tok.Token]:
    """Every --join token checked before anything starts: one clear line otherwise."""
    try:
        return [tok.check(tok.parse(t), now, mesh_id) for t in texts]
    except tok.TokenError as e:
        raise UserError(str(e)) from None


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
    from meshllm.machine.state import load_membership
    from meshllm.paths import state_dir

    try:
        return load_membership(state_dir(state)) is not None
    except UserError:
        return False


def node_options(args: argparse.Namespace) -> NodeOptions:
    """The node's options from its command line, checked against each other (one line for a contradiction).
    Computed without side effects: the binaries (found or built) and a --listen-all node's generated API key are the
    caller's to add (``cli/node.py``)."""
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

    opts = NodeOptions(
        model=args.model, client=args.client, join=tokens, state_dir=args.state_dir, bind_host=args.bind_host,
        bind_port=args.bind_port, advertise=args.advertise or [], token_ttl_s=args.token_ttl,
        admission_s=args.admission,
        relay=args.relay, relay_mode=args.relay_mode, relay_rate=args.relay_rate, join_lan=args.join_lan,
        announce=args.announce, max_ram_gb=args.max_ram,
        max_vram_gb=args.max_vram, ctx_size=args.ctx_size, parallel=args.parallel, queue=args.queue,
        tuning=tuning, tensor_split=args.tensor_split, split_replicas=args.split_replicas, port=args.port,
        listen_all=args.listen_all, api_key=api_key, max_tokens=args.max_tokens, bins=None, auto_model=auto,
        models_dir=args.models_dir,
        draft=args.draft, draft_max=args.draft_max, no_draft=args.no_draft, console_port=args.console,
        rpc_path=args.rpc_path, rpc_port=args.rpc_port, name=args.name or "", share=args.share == "on",
        fetch_all=args.fetch == "all", auto_fetch=auto_fetch,
    )  # fmt: skip
    return opts
