"""A node's start, before anything listens: every input checked (one clear line otherwise), in an order that writes
nothing before the inputs are known good — the state dir (and its lock: one node per state dir), the ports, the
--join tokens, the model — then the node's key and its membership of the mesh (a new one, founded here, when it has
none and no token)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console

from meshllm.errors import UserError
from meshllm.llama.processes import ANY_ADDR, port_in_use, udp_free
from meshllm.machine.state import (
    Membership,
    check_dir,
    load_membership,
    load_or_create_key,
    save_membership,
    saved_port,
    take_lock,
)
from meshllm.net.meshnet import new_mesh
from meshllm.proto import admission as adm
from meshllm.proto import token as tok
from meshllm.proto.layout import ModelShape
from meshllm.serve.fetch.fetching import is_local
from meshllm.serve.fetch.modelfiles import ModelFiles, open_model
from meshllm.serve.options import NodeOptions, parse_tokens


@dataclass
class Start:
    tokens: list[tok.Token]
    key: Ed25519PrivateKey
    membership: Membership | None  # None: joining through ``tokens``
    model: ModelFiles | None
    shape: ModelShape | None
    wanted: str | None  # --model this machine lacks, to fetch once in the mesh (serve/fetch/fetching.py)
    lock: int  # the state dir's lock, held for the node's life
    udp_port: int  # 0: any


def start_checks(o: NodeOptions, state: Path, api_host: str, console: Console) -> Start:
    now = time.time()  # wall: token expiry and the mesh's founding link
    check_dir(state)  # before anything is written: the tokens first
    # one node per state dir (a second one would take our identity); a running node's dir exists, so this comes
    # before the port checks: the same command twice names the running node, not its port
    lock = take_lock(state) if state.is_dir() else None
    if port_in_use(o.port, api_host):
        raise UserError(f"port {o.port} is in use: stop what runs there or pass --port N")
    if o.console_port is not None and port_in_use(o.console_port):  # before founding or joining anything
        raise UserError(f"--console {o.console_port}: port {o.console_port} is in use: stop what runs there or pass "
                        "another")  # fmt: skip
    for taken in (o.rpc_port, o.rpc_port + 1) if o.rpc_port is not None else ():
        if port_in_use(taken, ANY_ADDR):  # the direct path's TLS port and the links between workers' (PORT+1)
            raise UserError(f"--rpc-port {o.rpc_port}: port {taken} is in use: stop what runs there or pass another")
    m = load_membership(state)
    tokens = parse_tokens(o.join, now, m.mesh_id if m else None)  # before anything is written
    model = shape = wanted = None
    joins = bool(tokens) or (o.join_lan is not None and m is None)  # --join-lan: a token comes with the approval
    if o.model is not None and (joins or m is not None) and not is_local(str(o.model), o.models_dir):
        wanted = str(o.model)  # a member: from the mesh's members that have it (the hub if none does)
    elif o.model is not None:
        model, shape, note = open_model(o.model, o.models_dir, o.draft, o.no_draft)
        if note:
            console.print(note)
    lock = lock if lock is not None else take_lock(state)  # the inputs are good: now the dir may be made
    key = load_or_create_key(state)
    if m is not None and now >= adm.chain_until(m.chain) and not tokens:
        raise UserError(f"this node's admission to mesh {m.mesh_id.hex()[:8]} ended "
                        f"{int(now - adm.chain_until(m.chain))} s ago (it was away longer than its admission "
                        "held): start it with --join and a new token from a member")  # fmt: skip
    if m is None and not joins:
        m = new_mesh(key, now)
        console.print(f"new mesh [bold]{m.mesh_id.hex()[:8]}[/] founded by this node")
    if m is not None:
        m.incarnation += 1  # a new life: outranks our old records and tombstones
        save_membership(state, m)
    # the UDP port of the last run, where it is free: invite tokens minted before name it, and peers know it
    saved = saved_port(state) if m is not None else 0
    udp = o.bind_port or (saved if udp_free(o.bind_host, saved) else 0)
    return Start(tokens, key, m, model, shape, wanted, lock, udp)
