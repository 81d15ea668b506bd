"""Where mesh-llm keeps things on disk, and how a private file is written there.

- cache (rebuildable: llama.cpp source and builds, the tiny test model):
  $MESH_LLM_CACHE, else $XDG_CACHE_HOME/mesh-llm, else ~/.cache/mesh-llm
- state (identity key, invite token): --state-dir, else $MESH_LLM_HOME, else ~/.mesh-llm
- models: --models-dir, else $MESH_LLM_MODELS, else ~/.models
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from meshllm.errors import UserError


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


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (its folder made 0700 if missing, and made 0700 if others
    may write to it). The temporary file is always a new one of ours: whatever stands at its name (a file or a
    symlink someone planted there) is removed first, never written through or kept with its own mode."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tighten_dir(path.parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}; pass another --state-dir") from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def tighten_dir(folder: Path) -> None:
    """A state dir others can write to (an old one made 0777) lets them plant files: ours is made 0700; one we do
    not own is refused."""
    st = folder.stat()
    if st.st_mode & 0o022:
        if st.st_uid != os.getuid() or st.st_mode & 0o1000:  # not ours, or a shared folder such as /tmp (sticky)
            raise UserError(f"state dir {folder} is a folder others can write to: pass a --state-dir of its own")
        folder.chmod(0o700)
