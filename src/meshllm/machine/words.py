"""The signed words a node leaves in its state dir for the running node to gossip: revocations, admin grants,
`serve` / `drop` directives and a new admission secret. Each is signed with the node's key (the founder's, or an
admin's where the mesh allows it), kept in the state dir, and taken by the running node within a tick. Each
function returns the line the command prints; a word the mesh would refuse is one ``UserError`` line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import TypeVar

from meshllm.errors import RemoteProtocolError, UserError
from meshllm.machine.state import (
    ADMINS,
    REVOKED,
    Membership,
    has_node,
    load_directives,
    load_membership,
    load_or_create_key,
    load_rekey,
    load_signed,
    save_directives,
    save_rekey,
    save_signed,
)
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.auth import make_rekey

W = TypeVar("W", bound=sgn.SignedWord)


def member_state(sd: Path) -> Membership:
    """The membership kept in the state dir ``sd``; one line when it holds none. Whether the node there may sign a
    word is checked where its key signs (``sgn.revoke``, ``make_rekey``)."""
    m = load_membership(sd) if has_node(sd) else None
    if m is None:
        raise UserError(f"no mesh member in {sd}: run this where the mesh's founder keeps its state (--state-dir)")
    return m


def node_arg(sd: Path, text: str) -> bytes:
    """A node id as typed: all 64 hex digits, or 8 or more of a node the node in ``sd`` knows (its status.json)."""
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


def _admins(sd: Path, m: Membership) -> set[bytes]:
    return {sgn.grant_from_wire(o, m.mesh_id).node for o in load_signed(sd, ADMINS)}


def _add_signed(sd: Path, name: str, have: list[W], word: W, already: str, done: str) -> str:
    """Keep a new revocation or admin grant in the state dir (``revoked``, ``admins``); or say it is there
    already."""
    if any(x.node == word.node for x in have):
        return already
    save_signed(sd, name, [*have, word])
    return done


def revoke(sd: Path, who: str) -> str:
    """``mesh-llm revoke NODE``: the member, and every node it admitted, dropped and refused by every member."""
    m = member_state(sd)
    key, node, admins = load_or_create_key(sd), node_arg(sd, who), _admins(sd, m)
    try:
        r = sgn.revoke(key, m.mesh_id, node, time.time(), admins)
    except ValueError as e:
        raise UserError(str(e)) from None
    have = [sgn.revocation_from_wire(o, m.mesh_id, admins) for o in load_signed(sd, REVOKED)]
    return _add_signed(sd, REVOKED, have, r, f"{crypto.short(node)} was already revoked",
                       f"revoked {crypto.short(node)}: the running node gossips it within a second; every member "
                       "drops it and every node it admitted, and refuses them from now on")  # fmt: skip


def grant_admin(sd: Path, who: str) -> str:
    """``mesh-llm admin NODE`` (the founder only): that member may revoke others too."""
    m = member_state(sd)
    node = node_arg(sd, who)
    try:
        g = sgn.grant_admin(load_or_create_key(sd), m.mesh_id, node, time.time())
    except ValueError as e:
        raise UserError(str(e)) from None
    have = [sgn.grant_from_wire(o, m.mesh_id) for o in load_signed(sd, ADMINS)]
    return _add_signed(sd, ADMINS, have, g, f"{crypto.short(node)} is an admin already",
                       f"{crypto.short(node)} is an admin: the running founder gossips it within a second; from then "
                       "on `mesh-llm revoke` works on that node's machine too")  # fmt: skip


def direct(sd: Path, name: str, serve: bool) -> str:
    """``mesh-llm serve NAME`` / ``mesh-llm drop NAME``: the newest word about a model counts."""
    m = member_state(sd)
    admins = _admins(sd, m)
    have = []
    for o in load_directives(sd):  # what the running node keeps (a word by an admin revoked since is left out)
        with contextlib.suppress(RemoteProtocolError):
            have.append(sgn.directive_from_wire(o, m.mesh_id, admins))
    last = max((d.at for d in have if d.model == name), default=0)  # a word about it a second ago: later still
    try:
        d = sgn.direct(load_or_create_key(sd), m.mesh_id, name, serve, max(time.time(), last + 1), admins)
    except ValueError as e:
        raise UserError(str(e)) from None
    save_directives(sd, [*(h for h in have if h.model != d.model), d])
    if serve:
        return (f"serve {d.model}: the running node gossips it within a second; the nodes that hold {d.model} serve "
                "it (again), and a node started with --model auto that serves nothing fetches it and serves it")
    return (f"drop {d.model}: the running node gossips it within a second; every node that serves {d.model} stops its "
            f"llama-server and stands by, and no node lists it; `mesh-llm serve {d.model}` brings it back")


def rotate(sd: Path) -> str:
    """``mesh-llm rotate`` (the founder only): a new admission secret; tokens minted before admit nobody."""
    m = member_state(sd)
    pending = load_rekey(sd)
    epoch = max(m.epoch, pending[1] if pending else 0) + 1
    try:
        r = make_rekey(load_or_create_key(sd), m.mesh_id, epoch, os.urandom(tok.SECRET_LEN))
    except ValueError as e:
        raise UserError(str(e)) from None
    save_rekey(sd, r.mesh_id, r.epoch, r.secret, r.by, r.sig)
    return (f"mesh {m.mesh_id.hex()[:8]}: new admission secret (epoch {epoch}). The running founder passes it to every "
            "member within a second; from then on tokens minted before admit nobody, and members stay members. The "
            f"founder's new invite token is in {sd / 'token'} (`mesh-llm token` prints one).")
