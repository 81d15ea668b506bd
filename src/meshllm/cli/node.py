"""``mesh-llm [--model MODEL] [--join TOKEN | --client]``: run a node. Its flags (beside llama-server's serving
options, ``serve/split/serving_flags.py``), the binaries found or built (the one place a build may start), then
the node itself (``serve/node.py``), registered on this machine for ``ps``, ``stop`` and ``logs``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from meshllm.cli import args as a
from meshllm.cli import console
from meshllm.proto import token as tok
from meshllm.proto.reach import RELAY_RATE, RelayMode


def run(args: argparse.Namespace) -> int:
    from meshllm.cli.build import ensure_binaries
    from meshllm.machine.registry import LogFile, registered
    from meshllm.paths import state_dir as node_state_dir
    from meshllm.serve.node import run_node
    from meshllm.serve.options import node_options
    from meshllm.serve.report.terminal import terminal_for_node

    opts = node_options(args)
    state = node_state_dir(args.state_dir)
    if opts.listen_all and not opts.api_key:
        opts = dataclasses.replace(opts, api_key=_new_api_key(state))
    if not opts.client:
        opts = dataclasses.replace(opts, bins=ensure_binaries(args.bin_dir))
    model = str(args.model or ("lite client" if args.client else ""))
    with registered(state, f"http://127.0.0.1:{args.port}/v1", model):  # `mesh-llm ps`, `stop`, `logs`
        return run_node(opts, terminal_for_node(getattr(args, "verbose", False), LogFile(state)))


def _new_api_key(state: Path) -> str:
    """A --listen-all node with no key gets one, saved in its state dir (0600); printed only to a terminal."""
    import secrets
    import sys

    from meshllm.machine.state import save_api_key

    key = secrets.token_urlsafe(24)
    path = save_api_key(state, key)
    where = f"API key (also in {path}): {key}" if sys.stderr.isatty() else f"API key written to {path}"
    console.print(f"--listen-all: requests need 'Authorization: Bearer <key>'. {where}")
    return key


def add_node_args(p: argparse.ArgumentParser) -> None:
    """The options of ``mesh-llm`` itself (a node), beside its serving options (``split/serving_flags.py``)."""
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
    p.add_argument("--join", type=a.nonempty, action="append", metavar="TOKEN", help="invite token (repeatable)")
    p.add_argument("--join-lan", nargs="?", const="", metavar="MESH",
                   help="find a mesh announced on this LAN (MESH: its id, or the announcing node's id or name, when "
                        "there are several) and ask to join; a member there lets this node in with `mesh-llm approve`")
    p.add_argument("--no-announce", dest="announce", action="store_false",
                   help="the founder (or an admin) does not announce its mesh on the LAN (mDNS)")  # fmt: skip
    p.add_argument("--join-file", action="append", metavar="PATH", help="file holding invite token(s)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="node state (default $MESH_LLM_HOME or ~/.mesh-llm)")
    p.add_argument("--bind-host", type=a.ip_address, default="0.0.0.0",
                   help="UDP address to bind (default all, IPv4 and IPv6)")
    p.add_argument("--bind-port", type=a.udp_port_or_zero, default=0, help="UDP port for the mesh (default ephemeral)")
    p.add_argument(
        "--advertise", type=a.host_port, action="append", metavar="HOST:PORT", help="address peers should dial"
    )
    p.add_argument(
        "--relay", type=a.host_port, metavar="HOST:PORT", help="relay through this member when a peer is unreachable"
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
    p.add_argument("--relay-rate", type=a.relay_rate, default=RELAY_RATE, metavar="MB_PER_S",
                   help=f"when relaying, forward at most this many MB/s per pair of members (default "
                        f"{RELAY_RATE / 2**20:g}; 0: no cap)")  # fmt: skip
    p.add_argument("--token-ttl", type=a.parse_duration, default=86400.0, metavar="DURATION", help="default 1d")
    p.add_argument("--admission", type=a.admission, default=tok.ADMIT_S, metavar="DURATION",
                   help="how long a member this node admits (or renews) stays in unless renewed; members in good "
                        f"standing renew themselves at half time (default {tok.ADMIT_S // 86400}d, at most "
                        f"{tok.MAX_ADMIT_S // 86400}d)")  # fmt: skip
    p.add_argument("--max-vram", type=a.gigabytes, metavar="GB", help="cap the memory this node offers")
    p.add_argument("--max-ram", type=a.ram_gigabytes, metavar="GB",
                   help="cap the RAM this node offers besides, for a MoE model's routed experts when the mesh's "
                        "accelerator memory is short (default: three quarters of its RAM; 0: none)")  # fmt: skip
    p.add_argument("--tensor-split", type=a.parse_split, metavar="P,P,...", help="override the split plan")
    p.add_argument("--split-replicas", action=argparse.BooleanOptionalAction, default=True,
                   help="let the nodes the host's plan leaves out, which hold the model only together, serve it as a "
                        "second split (a replica that is a split; default on)")  # fmt: skip
    p.add_argument("--name", type=a.parse_name, metavar="NAME",
                   help="how other nodes show this one (default: hostname)")
    p.add_argument("--port", type=a.tcp_port, default=9337, help="API port (default 9337)")
    p.add_argument("--listen-all", action="store_true", help="API on all interfaces (then an API key is required)")
    p.add_argument("--api-key", type=a.nonempty, metavar="KEY", help="require this API key (or $MESH_LLM_API_KEY)")
    p.add_argument("--max-tokens", type=a.positive_int, metavar="N",
                   help="the most tokens one request may generate, on the API and the console (a request asking for "
                   "more, or not saying, gets N); default: no cap, 4096 for one not saying")  # fmt: skip
    p.add_argument("--bin-dir", type=Path, metavar="DIR", help="your own ggml-rpc-server and llama-server")
    p.add_argument("--console", nargs="?", type=a.tcp_port, const=3131, metavar="PORT",
                   help="web console on 127.0.0.1 (default port 3131)")  # fmt: skip
    p.add_argument("--draft", type=a.nonempty, metavar="PATH|NAME", help="draft model for speculative decoding")
    p.add_argument("--draft-max", type=a.draft_max, default=8, metavar="N", help="tokens drafted per step (default 8)")
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
        "--rpc-port", type=a.rpc_port, metavar="PORT",
        help="this worker's TLS RPC port for the direct path, and PORT+1 for the links between workers (default: any "
             "free ones); open both between your machines",
    )  # fmt: skip
    p.add_argument(
        "--models-dir", type=Path, metavar="DIR", help="where models live (default $MESH_LLM_MODELS or ~/.models)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
