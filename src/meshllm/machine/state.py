"""A node's files in its state dir (default ~/.mesh-llm, or --state-dir / $MESH_LLM_HOME). This module is the only
one that names them; everything is written atomically (a temporary file, then rename) with its mode from the start.

    (the dir)          made 0700
    key                Ed25519 private key, raw 32 bytes                        0600, checked on load
    mesh.json          mesh id, admission secret (+ epoch, the founder's        0600, checked on load
                       signature of it, earlier secrets), chain, incarnation
    revoked            the revocations this node knows (all members)            0600, checked on load
    admins             the founder's admin grants this node knows (all members) 0600, checked on load
    rekey              founder: the new secret `mesh-llm rotate` made           0600, checked on load
    token              the latest invite token this node minted                 0600
    api-key            the generated API key of a --listen-all node             0600
    node.json          the addresses this node listens on / members see it at   0600
    members.json       every member seen (proto/ledger.py): what a restart dials 0600
    status.json        the node's view of the mesh (as /mesh/status)            0600
    rpc-server.keys    worker: the TLS identity + key its rpc-server accepts     0600, rewritten per host/plan
    rpc-client.keys    host: endpoint, identity, key per directly reached worker  0600, rewritten per start
    knocks             LAN: nodes that asked to join and wait for approval      0600
    approvals          LAN: `mesh-llm approve`: a token per approved node       0600
    refusals           LAN: `mesh-llm refuse`: nodes whose knocks are refused   0600
    llama-server.log,  the children's output                                    (theirs)
    rpc-server.log

Secrets are never logged.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import UserError
from meshllm.paths import tighten_dir, write_private
from meshllm.proto import admission as adm
from meshllm.proto import crypto, ledger
from meshllm.proto import signed as sgn


def check_dir(state: Path) -> None:
    """Whether the state dir can be used, without making it (nothing is written before the inputs are checked):
    it is a writable directory, or the nearest existing folder above it is. One clear line otherwise."""
    p = state
    while not p.exists() and p != p.parent:
        p = p.parent
    if p == state and not p.is_dir():
        raise UserError(f"state dir {state}: not a directory; pass another --state-dir")
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"state dir {state}: cannot create or write it under {p}; pass another --state-dir")


def take_lock(state: Path) -> int:
    """One node per state dir: an exclusive lock on ``state/lock`` (held until this process exits; the file says our
    pid), or one line naming the node that holds it. Makes the dir (after check_dir) if it is not there yet."""
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    tighten_dir(state)
    path = state / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise UserError(f"state dir {state}: cannot open its lock file: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"another mesh-llm (pid {held}) runs on state dir {state}: stop it first, or give this one "
                        "another --state-dir") from None  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def running_pid(state: Path) -> int | None:
    """The pid of the node that holds this state dir's lock (:func:`take_lock`), or None when no node runs there."""
    try:
        fd = os.open(state / "lock", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        text = os.read(fd, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
    return None  # we could lock it: nobody holds it


def check_private(path: Path) -> None:
    """A secret file others can read is refused, not used."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UserError(f"{path} is readable by others (mode {mode:o}): chmod 600 {path}")


def has_node(state: Path) -> bool:
    return (state / "key").exists()


def load_or_create_key(state: Path) -> Ed25519PrivateKey:
    path = state / "key"
    if path.exists():
        check_private(path)
        raw = path.read_bytes()
        if len(raw) != 32:
            raise UserError(f"{path} is not a mesh-llm key (expected 32 bytes)")
        return crypto.key_from_bytes(raw)
    key = crypto.new_key()
    write_private(path, crypto.key_to_bytes(key))
    return key


@dataclass
class Membership:
    mesh_id: bytes
    secret: bytes
    chain: list[adm.Link]
    incarnation: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    epoch: int = 0  # how many times the founder rotated the secret
    rekey_sig: bytes = b""  # the founder's signature of (mesh, epoch, secret): proof to pass on (epoch 0: none)
    previous: list[bytes] = field(default_factory=list)  # earlier secrets, newest first (members may still use them)

    @property
    def founder(self) -> bytes:
        return self.chain[0][1]


def load_membership(state: Path) -> Membership | None:
    path = state / "mesh.json"
    if not path.exists():
        return None
    check_private(path)
    try:
        d = json.loads(path.read_text())
        if any(len(link) not in (7, 8) for link in d["chain"]):
            raise UserError(f"{path} is from an older mesh-llm (admission without scopes or ends): move it away, "
                            "then start a new mesh or join again with a new token")  # fmt: skip
        chain: list[adm.Link] = [
            (bytes.fromhex(m), bytes.fromhex(n), bytes.fromhex(b), int(at), int(until), int(sc), bytes.fromhex(s),
             tuple(bytes.fromhex(v) for v in (via[0] if via else [])))
            for m, n, b, at, until, sc, s, *via in d["chain"]
        ]  # fmt: skip
        return Membership(
            mesh_id=bytes.fromhex(d["mesh_id"]),
            secret=base64.b64decode(d["secret"]),
            chain=chain,
            incarnation=int(d.get("incarnation", 0)),
            epoch=int(d.get("epoch", 0)),
            rekey_sig=bytes.fromhex(d.get("rekey_sig", "")),
            previous=[base64.b64decode(s) for s in d.get("previous", [])],
        )
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is damaged ({e}); move it away to start a new mesh") from None


def save_membership(state: Path, m: Membership) -> None:
    d = {
        "mesh_id": m.mesh_id.hex(),
        "secret": base64.b64encode(m.secret).decode(),
        "chain": [[mid.hex(), n.hex(), b.hex(), at, until, sc, s.hex(), *([[v.hex() for v in via]] if via else [])]
                  for mid, n, b, at, until, sc, s, via in m.chain],
        "incarnation": m.incarnation,
        "epoch": m.epoch,
        "rekey_sig": m.rekey_sig.hex(),
        "previous": [base64.b64encode(s).decode() for s in m.previous],
    }
    write_private(state / "mesh.json", (json.dumps(d, indent=1) + "\n").encode())


def save_token(state: Path, text: str) -> Path:
    path = state / "token"
    write_private(path, (text + "\n").encode())
    return path


def load_token(state: Path) -> str | None:
    path = state / "token"
    return path.read_text().strip() if path.exists() else None


def save_api_key(state: Path, key: str) -> Path:
    path = state / "api-key"
    write_private(path, (key + "\n").encode())
    return path


def save_addrs(state: Path, addrs: list[str]) -> None:
    write_private(state / "node.json", json.dumps({"addrs": addrs}).encode())


def load_addrs(state: Path) -> list[str]:
    try:
        addrs = json.loads((state / "node.json").read_text())["addrs"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"no addresses recorded in {state}/node.json: start the node once first") from None
    if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
        raise UserError(f"{state}/node.json is damaged: start the node once more")
    return addrs


def save_members(state: Path, led: ledger.Ledger) -> None:
    """The members this node has seen (proto/ledger.py): what a restart dials."""
    write_private(state / "members.json", json.dumps(ledger.to_wire(led), sort_keys=True).encode())


def load_ledger(state: Path, me: bytes, wall: float) -> ledger.Ledger:
    """The members saved by :func:`save_members` (none when the file is missing or damaged: a restart then waits to
    be dialled)."""
    try:
        data = json.loads((state / "members.json").read_text())
    except (OSError, ValueError):
        data = None
    return ledger.from_wire(me, data, wall)


def load_members(state: Path) -> list[tuple[bytes, list[str]]]:
    """The members this node has seen and where, the most recently seen first (for the others a token names)."""
    return load_ledger(state, b"", time.time()).ordered()


def saved_port(state: Path) -> int:
    """The UDP port this node listened on last time (0: none recorded)."""
    try:
        addrs = json.loads((state / "node.json").read_text())["addrs"]
        return int(str(addrs[0]).rsplit(":", 1)[1])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return 0


def save_status(state: Path, text: str) -> None:
    write_private(state / "status.json", text.encode())


def rpc_server_keys(state: Path) -> Path:
    """Worker: the file its rpc-server reads the accepted TLS keys from, at every connection (patch 0005)."""
    return state / "rpc-server.keys"


def save_rpc_server_key(state: Path, identity: str, key: bytes | None, peer_ip: str | None = None) -> None:
    """The one identity and key our rpc-server accepts from now on (None: none; every TLS client is refused), and
    the one address it accepts it from (patch 0008: a TLS client from any other address is refused before its
    handshake)."""
    row = f"{identity} {peer_ip} {key.hex() if key else ''}" if peer_ip else f"{identity} {key.hex() if key else ''}"
    write_private(rpc_server_keys(state), f"{row}\n".encode() if key else b"")


def rpc_client_keys(state: Path) -> Path:
    return state / "rpc-client.keys"


def save_rpc_client_keys(state: Path, rows: list[tuple[str, str, bytes]]) -> Path:
    """Host: (endpoint, identity, key) for each worker its llama-server reaches directly; the file it reads."""
    path = rpc_client_keys(state)
    write_private(path, "".join(f"{ep} {ident} {key.hex()}\n" for ep, ident, key in rows).encode())
    return path


REVOKED = "revoked"
ADMINS = "admins"


def load_signed(state: Path, name: str) -> list[list[object]]:
    """The founder's (or an admin's) signed words this node knows — ``revoked`` (revocations) or ``admins`` (admin
    grants) — in wire form: the reader verifies each."""
    path = state / name
    if not path.exists():
        return []
    check_private(path)
    try:
        d = json.loads(path.read_text())
        return [[bytes.fromhex(m), bytes.fromhex(n), int(at), bytes.fromhex(b), bytes.fromhex(s)]
                for m, n, at, b, s in d]  # fmt: skip
    except (ValueError, TypeError) as e:
        raise UserError(f"{path} is damaged ({e})") from None


def save_signed(state: Path, name: str, words: Sequence[sgn.SignedWord]) -> None:
    rows = [[w.mesh_id.hex(), w.node.hex(), w.at, w.by.hex(), w.sig.hex()] for w in words]
    write_private(state / name, (json.dumps(rows, indent=1) + "\n").encode())


DIRECTIVES = "directives"


def load_directives(state: Path) -> list[list[object]]:
    """The serve / drop words this node knows (``mesh-llm serve`` / ``drop``), in wire form: the reader verifies."""
    path = state / DIRECTIVES
    if not path.exists():
        return []
    check_private(path)
    try:
        return [[bytes.fromhex(m), str(name), bool(serve), int(at), bytes.fromhex(b), bytes.fromhex(s)]
                for m, name, serve, at, b, s in json.loads(path.read_text())]  # fmt: skip
    except (ValueError, TypeError) as e:
        raise UserError(f"{path} is damaged ({e})") from None


def save_directives(state: Path, words: Sequence[sgn.Directive]) -> None:
    rows = [[d.mesh_id.hex(), d.model, d.serve, d.at, d.by.hex(), d.sig.hex()] for d in words]
    write_private(state / DIRECTIVES, (json.dumps(rows, indent=1) + "\n").encode())


def load_rekey(state: Path) -> tuple[bytes, int, bytes, bytes, bytes] | None:
    """What ``mesh-llm rotate`` left in ``rekey``: (mesh id, epoch, secret, founder, signature); the reader verifies."""
    path = state / "rekey"
    if not path.exists():
        return None
    check_private(path)
    try:
        d = json.loads(path.read_text())
        return (bytes.fromhex(d["mesh_id"]), int(d["epoch"]), base64.b64decode(d["secret"]), bytes.fromhex(d["by"]),
                bytes.fromhex(d["sig"]))  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is damaged ({e})") from None


def save_rekey(state: Path, mesh_id: bytes, epoch: int, secret: bytes, by: bytes, sig: bytes) -> None:
    d = {"mesh_id": mesh_id.hex(), "epoch": epoch, "secret": base64.b64encode(secret).decode(), "by": by.hex(),
         "sig": sig.hex()}  # fmt: skip
    write_private(state / "rekey", (json.dumps(d, indent=1) + "\n").encode())


def save_knocks(state: Path, rows: list[dict[str, object]]) -> None:
    """The knocks the running node lists (node hex, name, address, first heard: wall seconds)."""
    write_private(state / "knocks", json.dumps(rows).encode())


def load_knocks(state: Path) -> list[dict[str, object]]:
    try:
        rows = json.loads((state / "knocks").read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def save_refusals(state: Path, nodes: set[bytes]) -> None:
    """The nodes `mesh-llm refuse` named: their knocks are answered "refused"."""
    write_private(state / "refusals", json.dumps(sorted(n.hex() for n in nodes)).encode())


def load_refusals(state: Path) -> set[bytes]:
    try:
        rows = json.loads((state / "refusals").read_text())
        return {bytes.fromhex(n) for n in rows} if isinstance(rows, list) else set()
    except (OSError, ValueError, TypeError):
        return set()


def save_approvals(state: Path, approvals: dict[bytes, str]) -> None:
    """Tokens `mesh-llm approve` made, per node id, that the running node hands to each at its next knock."""
    write_private(state / "approvals", json.dumps({n.hex(): t for n, t in approvals.items()}).encode())


def load_approvals(state: Path) -> dict[bytes, str]:
    try:
        obj = json.loads((state / "approvals").read_text())
        return {bytes.fromhex(n): str(t) for n, t in obj.items()} if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}
