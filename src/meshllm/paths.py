"""Where mesh-llm keeps things on disk.

- cache (rebuildable: llama.cpp source and builds, the tiny test model):
  $MESH_LLM_CACHE, else $XDG_CACHE_HOME/mesh-llm, else ~/.cache/mesh-llm
- state (identity key, invite token): --state-dir, else $MESH_LLM_HOME, else ~/.mesh-llm
- models: --models-dir, else $MESH_LLM_MODELS, else ~/.models
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("MESH_LLM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mesh-llm"


def state_dir(override: str | os.PathLike[str] | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get("MESH_LLM_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".mesh-llm"


def models_dir(override: str | os.PathLike[str] | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get("MESH_LLM_MODELS")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".models"


def repo_root() -> Path | None:
    """The source checkout this package runs from (editable installs), if any."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "patches").is_dir():
            return parent
    return None
