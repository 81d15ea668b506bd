"""A node as a service — ``mesh-llm service install [NODE FLAGS]`` writes a systemd user unit that
runs this very mesh-llm with those flags, restarts it when it fails and starts it at boot (with lingering on);
``mesh-llm service remove`` takes it away. Tokens never go into a unit (it is readable, and ``systemctl`` shows its
command line): ``--join-file``, ``$MESH_LLM_JOIN`` in a 0600 environment file, or the config file carry them.

    mesh-llm service install --model gemma3-270m --join-file ~/.mesh-llm-token
    systemctl --user daemon-reload && systemctl --user enable --now mesh-llm
    loginctl enable-linger "$USER"      # start at boot, not at login
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from meshllm.errors import UserError

UNIT = "mesh-llm"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def unit_dir() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "systemd" / "user"


def unit_text(exe: str, flags: list[str], name: str = UNIT) -> str:
    """The unit that runs ``exe`` with ``flags``; UserError for a flag that would put a token in it."""
    for i, word in enumerate(flags):
        if word == "--join" or word.startswith("--join="):
            raise UserError("a token does not go into a service unit (systemctl and the unit file show it): use "
                            "--join-file PATH (mode 0600), or join = [...] in the config file")  # fmt: skip
        if word == "--api-key" or word.startswith("--api-key="):
            raise UserError("an API key does not go into a service unit: put api-key in the config file (0600)")
        if i == 0 and not word.startswith("-"):
            raise UserError(f"service install takes the node's flags (--model ...), not a subcommand ({word!r})")
    command = " ".join(shlex.quote(w) for w in [exe, *flags])
    return f"""[Unit]
Description=mesh-llm node ({name})
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
ExecStart={command}
Restart=on-failure
RestartSec=5
# SIGTERM: the node leaves the mesh and stops the llama.cpp processes it started; what is left goes after 30 s
KillMode=mixed
TimeoutStopSec=30
NoNewPrivileges=true

[Install]
WantedBy=default.target
"""


def install(flags: list[str], name: str = UNIT, exe: str | None = None) -> str:
    """Write the unit; the lines to print (where it went, what to run next)."""
    if not _NAME.fullmatch(name):
        raise UserError(f"--unit {name!r}: letters, digits, '.', '_' and '-' only")
    exe = exe or _this_mesh_llm()
    path = unit_dir() / f"{name}.service"
    text = unit_text(exe, flags, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return (f"wrote {path}\n"
            f"start it now and at every login: systemctl --user daemon-reload && systemctl --user enable --now {name}\n"
            f"at boot, before anyone logs in: loginctl enable-linger {os.environ.get('USER', '$USER')}\n"
            f"its lines: journalctl --user -u {name} -f   (or mesh-llm logs -f)")  # fmt: skip


def remove(name: str = UNIT) -> str:
    path = unit_dir() / f"{name}.service"
    if not path.is_file():
        raise UserError(f"no unit {path}")
    path.unlink()
    return f"removed {path}; then: systemctl --user disable --now {name}; systemctl --user daemon-reload"


def _this_mesh_llm() -> str:
    """The mesh-llm command this process runs as: the venv's script beside the interpreter where it is there."""
    beside = Path(sys.executable).parent / "mesh-llm"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return f"{sys.executable} -m meshllm.cli"
