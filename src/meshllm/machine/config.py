"""A config file for the node — every flag of ``mesh-llm`` (the node's command) as a TOML key, and
per-model serving options; flags on the command line override it.

    # ~/.config/mesh-llm/config.toml  (or --config FILE, or $MESH_LLM_CONFIG)
    model = "gemma3-270m"
    port = 9337
    max-vram = 8
    join-file = "~/.mesh-llm-token"
    no-draft = true

    [models."qwen3-32b"]        # only when --model (or model above) is this name
    ctx-size = 32768
    parallel = 4

A key is a flag's long name without its dashes (``max-vram`` or ``max_vram``); a switch takes true or false; a
repeatable flag (``join-file``, ``advertise``) a list. Each value goes through the flag's own parsing, so a bad one
is the same one line the flag would give, naming the file. A file holding a secret (``join``, ``api-key``) must be
readable by its owner only.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any

from meshllm.errors import UserError
from meshllm.machine.state import check_private

SECRETS = ("join", "api-key")
NOT_KEYS = ("help", "version", "config", "verbose")


def config_path(argv: list[str]) -> tuple[Path | None, bool]:
    """The config file for this command line: ``--config FILE``, else ``$MESH_LLM_CONFIG``, else
    ``$XDG_CONFIG_HOME/mesh-llm/config.toml`` (``~/.config``) where it exists; and whether it was named (a named
    file must exist)."""
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]).expanduser(), True
        if word.startswith("--config="):
            return Path(word.split("=", 1)[1]).expanduser(), True
    env = os.environ.get("MESH_LLM_CONFIG")
    if env:
        return Path(env).expanduser(), True
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    default = base / "mesh-llm" / "config.toml"
    return (default, False) if default.is_file() else (None, False)


def load(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise UserError(f"config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config {path}: not TOML: {e}") from None
    keys = {_key(k) for k in data} | {_key(k) for m in _models(path, data).values() for k in m}
    if keys & set(SECRETS):
        check_private(path)  # a token or a key: as the state dir's own files
    return data


def _key(k: str) -> str:
    return k.replace("_", "-")


def _models(path: Path, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    models = data.get("models", {})
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise UserError(f"config {path}: [models] holds one table per model name ([models.\"NAME\"])")
    return models


def apply(parser: argparse.ArgumentParser, path: Path, data: dict[str, Any], model: str | None = None) -> None:
    """The file's top-level keys (and, for ``model``, that model's table) as ``parser``'s defaults: flags given on
    the command line still win. UserError, one line naming the file, for an unknown key or a bad value."""
    table = {k: v for k, v in data.items() if k != "models"}
    if model is not None:
        table = _models(path, data).get(model, {})
    if not table:
        return
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    argv: list[str] = []
    used: list[argparse.Action] = []
    for raw, value in table.items():
        key = _key(raw)
        action = by_option.get(f"--{key}")
        if action is None or key in NOT_KEYS or isinstance(value, dict):
            hint = " (per-model options go in [models.\"NAME\"])" if isinstance(value, dict) else ""
            raise UserError(f"config {path}: unknown key {raw!r}: keys are mesh-llm's flags without the dashes, "
                            f"e.g. max-vram{hint}")  # fmt: skip
        argv += _as_argv(path, raw, f"--{key}", action, value)
        used.append(action)

    def fail(message: str) -> None:
        raise UserError(f"config {path}: {message}")

    error, parser.error = parser.error, fail  # type: ignore[method-assign, assignment]
    try:
        ns, rest = parser.parse_known_args(argv, argparse.Namespace())
    finally:
        parser.error = error  # type: ignore[method-assign]
    if rest:
        raise UserError(f"config {path}: cannot use {' '.join(rest)}")
    parser.set_defaults(**{a.dest: getattr(ns, a.dest) for a in used if hasattr(ns, a.dest)})


def _as_argv(path: Path, raw: str, opt: str, action: argparse.Action, value: object) -> list[str]:
    """The command-line words that say what ``raw = value`` says."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise UserError(f"config {path}: {raw} takes true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [opt if value else f"--no-{opt[2:]}"]
        return [opt] if value else []
    if isinstance(value, bool):
        if action.nargs == "?" and value:
            return [opt]
        raise UserError(f"config {path}: {raw} takes a value, not {str(value).lower()}")
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
        raise UserError(f"config {path}: {raw} takes one value, not a list")
    out: list[str] = []
    for v in values:
        if isinstance(v, (dict, list, bool)):
            raise UserError(f"config {path}: {raw} = {v!r} is not a value it takes")
        out += [opt, str(Path(v).expanduser()) if isinstance(v, str) and v.startswith("~") else str(v)]
    return out
