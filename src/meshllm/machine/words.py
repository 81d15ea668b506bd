"""The membership commands: invite tokens, LAN approvals, revocations, admins, serve / drop, secret rotation. Each
signs with the node's key in its state dir and leaves its word there, where the running node takes it within a tick
and gossips it (``cli.py`` parses their arguments)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from meshllm.errors import RemoteProtocolError, UserError
from meshllm.proto import token as tok

if TYPE_CHECKING:
    from meshllm.state import Membership

W = TypeVar("W", bound=tok.SignedWord)

def cmd_token(args: argparse.Namespace) -> int:

    from meshllm.net.meshnet import mint_scoped
    from meshllm.paths import state_dir
    from meshllm.state import has_node, load_addrs, load_members, load_membership, load_or_create_key, save_token

    sd = state_dir(args.state_dir)
    if not has_node(sd):
        raise UserError(f"no node in {sd}: start one with `mesh-llm --model ...` first (or pass --state-dir)")
    m = load_membership(sd)
    if m is None:
        raise UserError(f"the node in {sd} is not in a mesh yet")
    addrs = load_addrs(sd)
    also = list(load_members(sd).items())  # the members the node last knew: a joiner dials them too
    t = mint_scoped(load_or_create_key(sd), m, addrs, time.time(), args.ttl, args.scope, also)
    from meshllm.serve.report.narration import duration

    saved = ""
    if args.scope is None or args.scope == tok.chain_scope(m.chain):
        saved = f"; it replaces the invite saved in {save_token(sd, t.encode())}"  # a narrower one is only printed
    print(f"{t.scope} token, valid {duration(args.ttl)}{saved}:", file=sys.stderr)
    print(t.encode())
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    from meshllm.serve.life.lan import approve

    sd, _ = _founder_state(args.state_dir)
    print(approve(sd, args.node, args.scope))
    return 0


def cmd_refuse(args: argparse.Namespace) -> int:
    from meshllm.serve.life.lan import refuse

    sd, _ = _founder_state(args.state_dir)
    print(refuse(sd, args.node))
    return 0


def _founder_state(state: Path | None) -> tuple[Path, Membership]:
    """The state dir named (or the default) and its membership; one line when it holds none. Whether the node there
    founded the mesh is checked where the founder's key signs (``revoke``, ``make_rekey``)."""
    from meshllm.paths import state_dir
    from meshllm.state import has_node, load_membership

    sd = state_dir(state)
    m = load_membership(sd) if has_node(sd) else None
    if m is None:
        raise UserError(f"no mesh member in {sd}: run this where the mesh's founder keeps its state (--state-dir)")
    return sd, m


def _node_arg(sd: Path, text: str) -> bytes:
    """A node id as typed: all 64 hex digits, or 8 or more of a node the node in ``sd`` knows (its status.json)."""
    import json

    text = text.strip().lower()
    known: list[str] = []
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        known = [p["node"] for p in json.loads((sd / "status.json").read_text())["peers"]]
    found = [n for n in known if n.startswith(text)] if len(text) >= 8 else []
    if re.fullmatch(r"[0-9a-f]{64}", text):
        return bytes.fromhex(text)
    if len(found) == 1:
        return bytes.fromhex(found[0])
    raise UserError(f"{text!r}: give a node id as `mesh-llm status` shows it (8 or more hex digits of a node this "
                    "node knows, or all 64)")  # fmt: skip


def cmd_revoke(args: argparse.Namespace) -> int:
    from meshllm.proto import crypto
    from meshllm.state import ADMINS, REVOKED, load_or_create_key, load_signed

    sd, m = _founder_state(args.state_dir)
    key = load_or_create_key(sd)
    node = _node_arg(sd, args.node)
    admins = {tok.grant_from_wire(o, m.mesh_id).node for o in load_signed(sd, ADMINS)}
    try:
        r = tok.revoke(key, m.mesh_id, node, time.time(), admins)
    except ValueError as e:
        raise UserError(str(e)) from None
    have = [tok.revocation_from_wire(o, m.mesh_id, admins) for o in load_signed(sd, REVOKED)]
    _add_signed(sd, REVOKED, have, r, f"{crypto.short(node)} was already revoked",
                f"revoked {crypto.short(node)}: the running node gossips it within a second; every member drops it "
                "and every node it admitted, and refuses them from now on")  # fmt: skip
    return 0


def cmd_direct(args: argparse.Namespace) -> int:
    """``mesh-llm serve NAME`` / ``mesh-llm drop NAME``: the founder's (or an admin's) signed word, kept in the state
    dir, where the running node takes it within a tick and gossips it."""
    from meshllm.state import ADMINS, load_directives, load_or_create_key, load_signed, save_directives

    sd, m = _founder_state(args.state_dir)
    admins = {tok.grant_from_wire(o, m.mesh_id).node for o in load_signed(sd, ADMINS)}
    have = []
    for o in load_directives(sd):  # what the running node keeps (a word by an admin revoked since is left out)
        with contextlib.suppress(RemoteProtocolError):
            have.append(tok.directive_from_wire(o, m.mesh_id, admins))
    last = max((d.at for d in have if d.model == args.name), default=0)  # a word about it a second ago: later still
    try:
        d = tok.direct(load_or_create_key(sd), m.mesh_id, args.name, args.serve, max(time.time(), last + 1), admins)
    except ValueError as e:
        raise UserError(str(e)) from None
    save_directives(sd, [*(h for h in have if h.model != d.model), d])
    if args.serve:
        print(f"serve {d.model}: the running node gossips it within a second; the nodes that hold {d.model} serve it "
              "(again), and a node started with --model auto that serves nothing fetches it and serves it")  # fmt: skip
    else:
        print(f"drop {d.model}: the running node gossips it within a second; every node that serves {d.model} stops "
              f"its llama-server and stands by, and no node lists it; `mesh-llm serve {d.model}` brings it "
              "back")  # fmt: skip
    return 0


def _add_signed(sd: Path, name: str, have: list[W], word: W, already: str, done: str) -> None:
    """Keep a new revocation or admin grant in the state dir (``revoked``, ``admins``), where the running node
    takes it within a tick and gossips it; or say it is there already."""
    from meshllm.state import save_signed

    if any(x.node == word.node for x in have):
        print(already)
        return
    save_signed(sd, name, [*have, word])
    print(done)


def cmd_admin(args: argparse.Namespace) -> int:
    from meshllm.proto import crypto
    from meshllm.state import ADMINS, load_or_create_key, load_signed

    sd, m = _founder_state(args.state_dir)
    node = _node_arg(sd, args.node)
    try:
        g = tok.grant_admin(load_or_create_key(sd), m.mesh_id, node, time.time())
    except ValueError as e:
        raise UserError(str(e)) from None
    have = [tok.grant_from_wire(o, m.mesh_id) for o in load_signed(sd, ADMINS)]
    _add_signed(sd, ADMINS, have, g, f"{crypto.short(node)} is an admin already",
                f"{crypto.short(node)} is an admin: the running founder gossips it within a second; from then on "
                "`mesh-llm revoke` works on that node's machine too")  # fmt: skip
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    from meshllm.proto.auth import make_rekey
    from meshllm.proto.token import SECRET_LEN
    from meshllm.state import load_or_create_key, load_rekey, save_rekey

    sd, m = _founder_state(args.state_dir)
    pending = load_rekey(sd)
    epoch = max(m.epoch, pending[1] if pending else 0) + 1
    try:
        r = make_rekey(load_or_create_key(sd), m.mesh_id, epoch, os.urandom(SECRET_LEN))
    except ValueError as e:
        raise UserError(str(e)) from None
    save_rekey(sd, r.mesh_id, r.epoch, r.secret, r.by, r.sig)
    print(f"mesh {m.mesh_id.hex()[:8]}: new admission secret (epoch {epoch}). The running founder passes it to every "
          "member within a second; from then on tokens minted before admit nobody, and members stay members. The "
          f"founder's new invite token is in {sd / 'token'} (`mesh-llm token` prints one).")  # fmt: skip
    return 0
