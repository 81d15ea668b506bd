"""Model downloads that resume across runs and are checked byte for byte, and every way a user can name a model.

huggingface_hub asks the hub (``HF_ENDPOINT``, ``HF_TOKEN`` honoured; tests point HF_ENDPOINT at a local stand-in)
where a file's bytes are and what its LFS sha256 and size are. The bytes we fetch ourselves with HTTP ranges into
``.partial/<sha256>.part`` beside the target, because huggingface_hub (2.x) deletes its partial file when a
download fails: a 20 GB model cut at 19 GB — Ctrl-C, a dead link — would start again from zero. Here a run resumes
from the bytes the last one kept, a connection that drops mid-file is resumed on the spot (5 tries, reset by
progress), and the token goes only to the hub's own origin, never to the CDN it redirects to. The finished file is
checked against the sha256; a mismatch is deleted and fetched once more, then refused. Only then does it take the
final name. Xet-backed files are fetched through the same redirect (the hub's HTTP bridge), not through hf-xet.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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


def hub_endpoint() -> str:
    import huggingface_hub.constants as c

    return str(c.ENDPOINT).rstrip("/")


def _on_the_hub(url: str) -> None:
    """A model URL must point at the hub we download from: another host would get our HF_TOKEN (or, silently,
    the same path fetched from the hub instead of the server the user named)."""
    if not _same_origin(url, hub_endpoint()):
        raise UserError(f"{url}: not a URL of the hub ({hub_endpoint()}); set HF_ENDPOINT to download from a mirror")


def inside(dest_dir: Path, filename: str) -> Path:
    """``dest_dir/filename`` for a file name that came from the user or the hub: one that could land anywhere else
    (``..``, an absolute path, a backslash, an empty part) is refused, whatever the hub library would do with it."""
    parts = filename.split("/")
    if filename.startswith("/") or "\\" in filename or "\0" in filename or any(p in ("", ".", "..") for p in parts):
        raise UserError(f"{filename!r}: not a file name inside a repository (no '..', '.', empty parts or '\\')")
    return dest_dir / filename


def download_file(repo: str, filename: str, dest_dir: Path, revision: str = "main") -> Path:
    """``dest_dir/filename``, fetched unless already there with the right content."""
    import huggingface_hub as hf

    target = inside(dest_dir, filename)
    if any(p in ("", ".", "..") for p in repo.split("/")) or revision in (".", ".."):
        raise UserError(f"{repo!r}: not a repository name")
    what = f"{repo}/{filename}"
    url = hf.hf_hub_url(repo, filename, revision=revision)
    try:
        meta = hf.get_hf_file_metadata(url)
    except Exception as e:
        raise _hub_error(e, what) from None
    expected = (meta.etag or "").strip('"').lower()
    expected = expected if _SHA256.match(expected) else ""
    same_size = target.is_file() and meta.size is not None and target.stat().st_size == meta.size
    if same_size and (not expected or _sha256(target) == expected):
        return target
    part = dest_dir / ".partial" / f"{expected or hashlib.sha256(url.encode()).hexdigest()}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    free = shutil.disk_usage(dest_dir).free
    if meta.size is not None and meta.size - have > free:
        raise UserError(f"{what}: needs {_size(meta.size - have)} more, {dest_dir} has {_size(free)} free")
    headers = {"User-Agent": "mesh-llm"}
    token = hf.get_token()
    if token and _same_origin(meta.location, hub_endpoint()):
        headers["Authorization"] = f"Bearer {token}"  # the hub's own origin only: never the CDN
    for attempt in (1, 2):
        _fetch(meta.location, part, meta.size, headers, what)
        if not expected or _sha256(part) == expected:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
            return target
        part.unlink()  # never keep corrupted bytes, not even to resume from
        if attempt == 2:
            raise UserError(f"{what}: downloaded twice, and twice its sha256 differed from the hub's: refused")
    raise AssertionError("unreachable")


TRIES = 5  # connection drops survived in a row without progress


def _fetch(url: str, part: Path, size: int | None, headers: dict[str, str], what: str) -> None:
    """Append ``url``'s bytes to ``part`` from where it ends until it has ``size`` bytes."""
    show = _Progress(what, size)
    tries = TRIES
    while True:
        have = part.stat().st_size if part.is_file() else 0
        if size is not None and have >= size:
            if have > size:  # longer than the file: not a prefix of it
                part.unlink()
                continue
            show.done()
            return
        req = urllib.request.Request(url, headers={**headers, **({"Range": f"bytes={have}-"} if have else {})})
        try:
            with _opener.open(req, timeout=30) as r, part.open("r+b" if have else "wb") as out:
                if have and r.status != 206:
                    out.truncate(0)  # the server sent the whole file, not the range
                    have = 0
                out.seek(have)
                while chunk := r.read(1 << 20):
                    out.write(chunk)
                    have += len(chunk)
                    show.update(have)
                    tries = TRIES
            if size is None:
                show.done()
                return
        except urllib.error.HTTPError as e:
            kept = f"; {_size(have)} kept, run again to resume" if have else ""
            raise UserError(f"{what}: the hub answered {e.code}{kept}") from None
        except (OSError, http.client.HTTPException) as e:  # a refused or dropped connection, a timeout
            tries -= 1
            if tries == 0:
                raise UserError(f"{what}: download failed ({e}); {_size(have)} kept, run again to resume") from None
            time.sleep(0.5 * (TRIES - tries))


class _Progress:
    """One line on stderr: rewritten in place on a terminal, every 10 % otherwise."""

    def __init__(self, what: str, size: int | None) -> None:
        self.what, self.size, self.t0, self.shown, self.first = what, size, time.monotonic(), -1, -1
        self.tty = sys.stderr.isatty()

    def update(self, have: int) -> None:
        if self.first < 0:
            self.first = have
        pct = int(100 * have / self.size) if self.size else 0
        if pct == self.shown or (not self.tty and pct // 10 == self.shown // 10):
            return
        self.shown = pct
        rate = (have - self.first) / max(time.monotonic() - self.t0, 1e-3) / 1e6
        total = f" of {_size(self.size)} ({pct} %)" if self.size else ""
        line = f"{self.what}: {_size(have)}{total}, {rate:.0f} MB/s"
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty and self.shown >= 0:
            print(file=sys.stderr)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class _NoTokenAcrossOrigins(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and not _same_origin(req.full_url, newurl):
            new.remove_header("Authorization")
        return new


_opener = urllib.request.build_opener(_NoTokenAcrossOrigins)


def _same_origin(a: str, b: str) -> bool:
    x, y = urlsplit(a), urlsplit(b)
    return (x.scheme, x.netloc) == (y.scheme, y.netloc)


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
        _on_the_hub(arg)
        return download_file(m["repo"], m["file"], where, revision=m["rev"]) if fetch else inside(where, m["file"])
    parts = arg.split("/")
    if len(parts) >= 3 and arg.endswith(".gguf") and not arg.startswith(("/", ".", "~")):
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        return download_file(repo, file, where) if fetch else inside(where, file)
    hints = catalog.closest(arg)
    hint = f"; did you mean {', '.join(hints)}?" if hints else "; `mesh-llm download` lists the catalog"
    raise UserError(f"unknown model {arg!r}: not a file, a catalog name or an installed model{hint}")


def check_catalog(say: Callable[[str], None]) -> int:
    """Compare every catalog entry with the hub (every file present, an LFS sha256 for each, total size within
    2 %); the number of entries that differ. Raises UserError when the hub cannot be asked at all."""
    import huggingface_hub as hf
    from huggingface_hub.errors import HfHubHTTPError

    api = hf.HfApi(endpoint=hub_endpoint())
    bad = 0
    for e in catalog.CATALOG:
        if e.pypi:
            continue
        try:
            infos = {i.path: i for i in api.get_paths_info(e.repo, list(e.files)) if isinstance(i, hf.hf_api.RepoFile)}
        except HfHubHTTPError as ex:
            say(f"bad {e.name}: {_hub_error(ex, e.repo)}")
            bad += 1
            continue
        except Exception as ex:  # no answer at all: nothing was checked, and that is not a pass
            why = type(ex).__name__
            raise UserError(f"cannot reach the hub at {hub_endpoint()} ({why}): nothing checked") from None
        missing = [f for f in e.files if f not in infos or infos[f].lfs is None]
        total = sum(i.size for i in infos.values())
        if missing:
            say(f"bad {e.name}: {e.repo}: missing on the hub: {', '.join(missing)}")
        elif abs(total / 1e9 - e.size_gb) > 0.02 * e.size_gb:
            say(f"bad {e.name}: {total / 1e9:.2f} GB on the hub, catalog says {e.size_gb}")
        else:
            say(f"ok  {e.name}: {total / 1e9:.2f} GB")
            continue
        bad += 1
    return bad


def token_present() -> bool:
    return bool(os.environ.get("HF_TOKEN"))
