"""What a node is told at start: its options (from the command line), and the inputs checked before anything
listens — the --join tokens, the memory it offers."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from meshllm.errors import UserError
from meshllm.llama.build import Binaries, gpu_visible
from meshllm.llama.processes import Tuning, device_listing
from meshllm.proto import token as tok
from meshllm.proto.capacity import Offer, offer, parse_devices
from meshllm.proto.gossip import MAX_NAME
from meshllm.proto.reach import RELAY_RATE, RelayMode


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
    max_ram_gb: float | None = None  # [big] --max-ram: RAM offered for routed experts
    ctx_size: int | None = None  # each slot's context (None: auto, planner.size)
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
