"""The pinned llama.cpp source and our patch series: the sdist it comes in (fetched once with pip, checked by
sha256, extracted without letting any member land outside the tree, on every Python of 3.11 or later), the series
read in order and both hashed into a build's cache key."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import BuildError
from meshllm.paths import cache_dir, repo_root


@dataclass(frozen=True)
class SourcePin:
    """The llama.cpp we build: upstream's tree as vendored in a llama-cpp-python sdist on PyPI."""

    package: str
    version: str
    sdist: str
    sha256: str
    subdir: str
    commit: str
    build: str


PINNED = SourcePin(
    package="llama-cpp-python",
    version="0.3.36",
    sdist="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    subdir="llama_cpp_python-0.3.36/vendor/llama.cpp",
    commit="0c1e57098",
    build="b11312",
)


# Top-level parts of the upstream tree the two targets never need; left out of each build's copy.
_SKIP_TOP = frozenset({"models", "docs", "media", ".git", "build"})


def _copy_ignore_for(root: Path) -> Callable[[str, list[str]], set[str]]:
    def ignore(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _SKIP_TOP} if Path(directory) == root else set()

    return ignore


def default_patch_dir() -> Path:
    env = os.environ.get("MESH_LLM_PATCHES")
    if env:
        return Path(env)
    root = repo_root()
    if root is None:
        raise BuildError(
            "cannot find patches/llama.cpp-rpc-local-gguf: run from a mesh-llm checkout or set MESH_LLM_PATCHES"
        )
    return root / "patches" / "llama.cpp-rpc-local-gguf"


def read_series(patch_dir: Path) -> tuple[Path, ...]:
    """The patches listed in ``series``, in order (blank lines and # comments skipped)."""
    series = patch_dir / "series"
    if not series.is_file():
        return ()
    out: list[Path] = []
    for raw in series.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        p = patch_dir / line
        if not p.is_file():
            raise BuildError(f"patch series lists {line} but {p} does not exist")
        out.append(p)
    return tuple(out)


def hash_patches(patches: tuple[Path, ...]) -> str:
    h = hashlib.sha256(b"mesh-llm patch series v1\n")
    for p in patches:
        h.update(p.name.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def hash_tree(root: Path) -> str:
    """Content hash of a user-supplied source tree (paths and bytes; build dirs and .git skipped)."""
    h = hashlib.sha256(b"mesh-llm tree v1\n")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "build", "models", "docs", "media"))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            h.update(str(p.relative_to(root)).encode() + b"\0")
            with p.open("rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_pinned_source(cache: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """The pristine upstream tree from the pinned sdist, downloaded and extracted once."""
    cache = cache or cache_dir()
    src_root = cache / "src"
    tree = src_root / f"llama.cpp-{PINNED.build}"
    if (tree / ".mesh-llm-complete").is_file():
        return tree
    src_root.mkdir(parents=True, exist_ok=True)
    sdist = src_root / PINNED.sdist
    if sdist.is_file() and _sha256_file(sdist) != PINNED.sha256:
        say(f"removing {sdist.name}: sha256 mismatch")
        sdist.unlink()
    if not sdist.is_file():
        say(f"downloading {PINNED.package}=={PINNED.version} (llama.cpp {PINNED.build}, ~77 MB) with pip")
        with tempfile.TemporaryDirectory(dir=src_root) as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "-q", "-d", tmp, f"{PINNED.package}=={PINNED.version}",
            ]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / PINNED.sdist
            if not got.is_file():
                # pip prepares metadata after downloading; that may fail without the build backend even though the
                # file is there. Only a missing file is an error.
                lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
                why = next((ln for ln in lines if "error" in ln.lower() or "×" in ln), lines[-1] if lines else "?")
                raise BuildError(f"pip download {PINNED.package}=={PINNED.version} failed: {why}")
            got.rename(sdist)
    digest = _sha256_file(sdist)
    if digest != PINNED.sha256:
        sdist.unlink()
        raise BuildError(f"{PINNED.sdist}: sha256 {digest} != pinned {PINNED.sha256}; removed it")
    say(f"extracting llama.cpp {PINNED.build} from {PINNED.sdist}")
    tmpdir = Path(tempfile.mkdtemp(dir=src_root, prefix=".extract-"))
    try:
        prefix = PINNED.subdir + "/"
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            _extract(tar, members, tmpdir)
        (tmpdir / ".mesh-llm-complete").write_text(json.dumps({"sdist_sha256": PINNED.sha256}))
        if tree.exists():
            shutil.rmtree(tree)
        tmpdir.rename(tree)
    finally:
        if tmpdir.exists():
            shutil.rmtree(tmpdir, ignore_errors=True)
    return tree


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """``members`` of ``tar`` under ``dest``, none outside it: with tarfile's "data" filter where this Python has it
    (3.11.4 and later), else (Debian 12's 3.11.2: ``extractall(filter=)`` is a TypeError there) only regular files
    and folders whose names stay inside, written with our own modes."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    root = dest.resolve()
    for m in members:
        target = (dest / m.name).resolve()
        if m.name.startswith("/") or (target != root and root not in target.parents):
            raise BuildError(f"{PINNED.sdist}: {m.name!r} would land outside the source tree")
        if m.isdir():
            target.mkdir(parents=True, exist_ok=True)
        elif m.isfile():
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            with src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(0o755 if m.mode & 0o100 else 0o644)
