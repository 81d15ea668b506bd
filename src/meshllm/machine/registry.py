"""The nodes that live on this machine — which run (``mesh-llm ps``), stopping one (``mesh-llm stop``)
and reading what it said (``mesh-llm logs [-f]``).

A running node registers itself in ``runtime_dir()/nodes/<pid>.json`` (its pid, state dir, API URL, model; 0600)
and keeps a log of every line its terminal shows in ``<state dir>/node.log`` (0600, one older file kept as
``node.log.1`` past LOG_MAX bytes; the invite token never goes there: it is printed to a terminal only). An entry is
listed only while the state dir's lock (``state.take_lock``) is held by that very pid, and dropped once that pid is
gone (a node killed with -9); and ``stop`` signals only the process that holds the lock of the state dir named: by pid,
never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from meshllm.errors import UserError
from meshllm.machine.state import running_pid
from meshllm.paths import cache_dir

LOG = "node.log"
LOG_MAX = 8 << 20  # bytes of node.log before it moves to node.log.1
STOP_WAIT_S = 30.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def runtime_dir() -> Path:
    """Where running nodes register: ``$XDG_RUNTIME_DIR/mesh-llm``, else the cache's ``run``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "mesh-llm" if xdg and Path(xdg).is_dir() else cache_dir() / "run"


# ------------------------------------------------------------------------------------------------ the registry


@contextlib.contextmanager
def registered(state: Path, api_url: str, model: str) -> Iterator[None]:
    """This process listed as a node running on ``state`` while the block runs."""
    path = runtime_dir() / "nodes" / f"{os.getpid()}.json"
    entry = {"pid": os.getpid(), "state_dir": str(state.resolve()), "api": api_url, "model": model,
             "started": int(time.time())}  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
    except OSError:
        path = Path()  # not listed (a read-only cache): the node runs all the same
    try:
        yield
    finally:
        if path != Path():
            with contextlib.suppress(OSError):
                path.unlink()


def running_nodes() -> list[dict[str, Any]]:
    """The nodes running on this machine now: each entry whose state dir's lock its pid holds (stale ones removed),
    with the node's own state from its last ``status.json``."""
    out = []
    for path in sorted((runtime_dir() / "nodes").glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            pid, state = int(entry["pid"]), Path(entry["state_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if running_pid(state) != pid:
            if not _alive(pid):
                with contextlib.suppress(OSError):
                    path.unlink()  # it ended without a word (kill -9): no longer listed
            continue  # alive, its lock not taken yet (starting), or another process now: not listed
        entry["state"] = _node_state(state)
        out.append(entry)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _node_state(state: Path) -> str:
    """What the node's last status says it is: its role and whether it serves (or "starting")."""
    try:
        d = json.loads((state / "status.json").read_text())
    except (OSError, ValueError):
        return "starting"
    me: dict[str, Any] = next((p for p in d.get("peers", []) if p.get("node") == d.get("node")), {})
    role, st = me.get("role", "?"), me.get("state", "?")
    return f"{role}, {st}"


# ------------------------------------------------------------------------------------------------ stop


def stop(state: Path, wait_s: float = STOP_WAIT_S) -> str:
    """Stop the node running on ``state`` (SIGTERM to the pid holding its lock: it leaves the mesh cleanly), waiting
    up to ``wait_s`` for it to end; the line to print. UserError when none runs there or it does not end."""
    pid = running_pid(state)
    if pid is None:
        raise UserError(f"no mesh-llm node runs on state dir {state}")
    if pid <= 0:
        raise UserError(f"the node on state dir {state} holds its lock but its pid is unreadable: stop it by hand")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"the node on {state} (pid {pid}) had already ended"
    except PermissionError:
        raise UserError(f"the node on {state} (pid {pid}) belongs to another user: stop it as that user") from None
    deadline = time.monotonic() + wait_s
    while running_pid(state) == pid:
        if time.monotonic() > deadline:
            raise UserError(f"the node on {state} (pid {pid}) did not end within {wait_s:.0f} s of SIGTERM: "
                            f"`kill -9 {pid}` ends it (its peers then notice within seconds)")  # fmt: skip
        time.sleep(0.1)
    return f"stopped the node on {state} (pid {pid}): it left the mesh"


# ------------------------------------------------------------------------------------------------ logs


class LogFile:
    """The terminal's lines, without colour codes, appended to ``<state>/node.log`` (opened once the state dir
    exists: a node makes it only after its inputs are checked), rotated past LOG_MAX."""

    def __init__(self, state: Path) -> None:
        self.path = state / LOG
        self.f: TextIO | None = None

    def flush(self) -> None:
        if self.f is not None:
            self.f.flush()

    def write(self, text: str) -> None:
        if self.f is None:
            if not self.path.parent.is_dir():
                return
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            except OSError:
                return
            self.f = os.fdopen(fd, "a", buffering=1)
        self.f.write(_ANSI.sub("", text))
        if self.f.tell() > LOG_MAX:
            self.f.close()
            self.f = None
            with contextlib.suppress(OSError):
                os.replace(self.path, self.path.with_suffix(".log.1"))


def logs(state: Path, lines: int, follow: bool, out: TextIO = sys.stdout) -> None:
    """The last ``lines`` lines of the node's log; with ``follow``, then every new one until interrupted (or until
    no node runs on ``state`` any more)."""
    path = state / LOG
    if not path.is_file():
        raise UserError(f"no log in {state}: no node has run on that state dir (or --state-dir names another)")
    with path.open(errors="replace") as f:
        tail = f.readlines()[-lines:] if lines > 0 else []
        out.writelines(tail)
        out.flush()
        while follow:
            line = f.readline()
            if line:
                out.write(line)
                out.flush()
                continue
            if running_pid(state) is None:
                return
            if path.stat().st_ino != os.fstat(f.fileno()).st_ino:  # rotated: the new file from its start
                f.close()
                f = path.open(errors="replace")
            time.sleep(0.2)
