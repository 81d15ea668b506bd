"""Downloads against the local hub stand-in (FAKE: tests/fakes/hub_standin.py), and model names."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshllm.errors import UserError
from meshllm.models import catalog
from meshllm.models.download import download_file, resolve
from tests.fakes.hub_standin import HubFile, HubStandin

DATA = os.urandom(3_000_000)
BIG = os.urandom(25 * 1024 * 1024)  # larger than any read chunk (huggingface_hub's was 10 MiB), so resumes show
CHUNK = 10 * 1024 * 1024
CUT = CHUNK + CHUNK // 2 + 123  # where the first GET drops the connection


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubStandin]:
    """The hub stand-in (hf-xet installed and not disabled; we never take the Xet path: models/download.py)."""
    h = HubStandin()
    h.start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", h.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", h.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(c, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    yield h


def test_fresh_download_goes_through_the_cdn_and_is_verified(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = f = HubFile(DATA)
    p = download_file("org/repo", "m.gguf", tmp_path / "models")
    assert p == tmp_path / "models" / "m.gguf" and p.read_bytes() == DATA
    assert f.gets == [""], "the bytes come from the CDN the hub redirects to, in one GET"
    assert download_file("org/repo", "m.gguf", tmp_path / "models") == p and len(f.gets) == 1, "fetched again"


def _resumed_at(rng: str) -> int:
    assert rng.startswith("bytes=") and rng.endswith("-"), rng
    return int(rng[6:-1])


def test_a_download_cut_halfway_resumes_within_the_call(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = f = HubFile(BIG, cut_after=CUT)
    p = download_file("org/repo", "m.gguf", tmp_path)
    assert p.read_bytes() == BIG and len(f.gets) == 2 and f.gets[0] == ""
    assert CHUNK <= _resumed_at(f.gets[1]) <= CUT, "the retry must continue from the bytes kept, not start over"


def test_a_failed_download_resumes_when_run_again(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = f = HubFile(BIG, cut_after=CUT, fail_after_cut=True)
    with pytest.raises(UserError, match=r"the hub answered 503; 15\.7 MB kept, run again to resume"):
        download_file("org/repo", "m.gguf", tmp_path)
    assert not (tmp_path / "m.gguf").exists(), "a half file under the final name"
    f.fail_after_cut = False
    p = download_file("org/repo", "m.gguf", tmp_path)  # run again: it resumes from what the first run kept
    assert p.read_bytes() == BIG and CHUNK <= _resumed_at(f.gets[-1]) <= CUT
    assert not list((tmp_path / ".partial").iterdir()), "the partial file outlived the download"


def test_corrupted_bytes_are_refused_and_refetched(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = f = HubFile(DATA, corrupt_once=True)
    p = download_file("org/repo", "m.gguf", tmp_path)
    assert p.read_bytes() == DATA and len(f.gets) == 2


def test_the_check_uses_the_lfs_sha256_not_the_etag(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = f = HubFile(DATA)
    (tmp_path / "m.gguf").write_bytes(bytes(b ^ 1 for b in DATA))  # the right size, the wrong bytes
    assert download_file("org/repo", "m.gguf", tmp_path).read_bytes() == DATA and len(f.gets) == 1


def test_404_and_401_are_one_clear_line(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA)
    with pytest.raises(UserError, match=r"not found on the hub \(404\)"):
        download_file("org/repo", "other.gguf", tmp_path)
    with pytest.raises(UserError, match=r"not found on the hub \(404\)"):
        download_file("org/none", "m.gguf", tmp_path)


def test_gated_models_need_hf_token_and_it_never_reaches_the_cdn(
    hub: HubStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.files["org/gated/m.gguf"] = f = HubFile(DATA)
    hub.tokens |= {"hf_granted", "hf_other"}
    hub.gated["org/gated"] = {"hf_granted"}
    with pytest.raises(UserError, match="accept its license on the hub and set HF_TOKEN"):
        download_file("org/gated", "m.gguf", tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_unknown")
    with pytest.raises(UserError, match=r"access denied \(401\): set HF_TOKEN"):
        download_file("org/gated", "m.gguf", tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_other")
    with pytest.raises(UserError, match="accept its license"):
        download_file("org/gated", "m.gguf", tmp_path)
    assert not f.gets
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert download_file("org/gated", "m.gguf", tmp_path).read_bytes() == DATA
    assert hub.cdn_saw_authorization == 0, "the hub token was sent to the CDN"


def test_a_url_of_another_host_is_refused(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA)
    other = f"http://127.0.0.1:{hub.cdn_port}/org/repo/resolve/main/m.gguf"
    with pytest.raises(UserError, match="not a URL of the hub"):
        resolve(other, tmp_path)
    assert not hub.files["org/repo/m.gguf"].gets


def test_a_file_name_that_climbs_out_of_the_models_dir_is_refused(hub: HubStandin, tmp_path: Path) -> None:
    """Low finding: `..` in `org/repo/file` and URL forms resolved outside the models dir (huggingface_hub
    refused it; we no longer rely on that). Nothing is asked of the hub, nothing is written outside."""
    models = tmp_path / "models"
    hub.files["org/repo/m.gguf"] = HubFile(DATA)
    url = f"{hub.url}/org/repo/resolve/main/../x.gguf"
    for arg in ["org/repo/../../../evil.gguf", "org/repo/sub/../../x.gguf", url, "org/repo//x.gguf",
                "org/repo/a\\..\\x.gguf"]:  # fmt: skip
        for fetch in (True, False):
            with pytest.raises(UserError, match="not a file name inside a repository"):
                resolve(arg, models, fetch=fetch)
    with pytest.raises(UserError, match="not a repository name"):
        download_file("org/..", "m.gguf", models)
    assert not hub.files["org/repo/m.gguf"].gets and not list(tmp_path.rglob("*.gguf"))


def _check(hub: HubStandin, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "MESH_LLM_MODELS": str(tmp_path)}
    env.pop("HF_TOKEN", None)
    cmd = [sys.executable, "-m", "meshllm.cli", "download", "--check"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_download_check_compares_the_catalog_with_the_hub(hub: HubStandin, tmp_path: Path) -> None:
    for e in catalog.CATALOG:
        if not e.pypi:
            for name in e.files:
                hub.files[f"{e.repo}/{name}"] = HubFile(declared_size=int(e.size_gb * 1e9 / len(e.files)))
    r = _check(hub, tmp_path)
    assert r.returncode == 0 and "the catalog matches the hub" in r.stdout, r.stdout + r.stderr
    e = next(e for e in catalog.CATALOG if not e.pypi and len(e.files) == 1)
    hub.files[f"{e.repo}/{e.files[0]}"].declared_size = int(e.size_gb * 1.5e9)
    multi = next(m for m in catalog.CATALOG if len(m.files) > 1)
    del hub.files[f"{multi.repo}/{multi.files[-1]}"]
    r = _check(hub, tmp_path)
    assert r.returncode == 1 and "2 of the catalog's entries differ" in r.stdout, r.stdout + r.stderr
    assert f"bad {e.name}:" in r.stdout and f"bad {multi.name}: {multi.repo}: missing on the hub" in r.stdout
    hub.stop()
    r = _check(hub, tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: cannot reach the hub at {hub.url} (ConnectError): nothing checked"
    ], r.stderr


def test_every_model_form_resolves(hub: HubStandin, tmp_path: Path, tiny_model: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA)
    assert resolve(str(tiny_model), tmp_path) == tiny_model  # a path
    assert resolve("gemma3-270m", tmp_path) == tiny_model  # a catalog name (the tiny one, from PyPI)
    assert resolve("org/repo/m.gguf", tmp_path).read_bytes() == DATA  # org/repo/file.gguf
    (tmp_path / "m.gguf").unlink()
    assert resolve(f"{hub.url}/org/repo/resolve/main/m.gguf", tmp_path).read_bytes() == DATA  # a hub URL
    assert resolve("m", tmp_path) == tmp_path / "m.gguf"  # an installed file, by name
    with pytest.raises(UserError, match=r"did you mean qwen2\.5-32b"):
        resolve("qwen2.5-32", tmp_path)


def test_catalog_is_well_formed() -> None:
    names = [e.name for e in catalog.CATALOG] + [a for e in catalog.CATALOG for a in e.aliases]
    assert len(names) == len(set(names)), "a name or alias used twice"
    for e in catalog.CATALOG:
        assert e.repo.count("/") == 1 and e.files and all(f.endswith(".gguf") for f in e.files)
        assert e.size_gb > 0 and e.source.startswith("https://")
        if len(e.files) > 1:
            assert all(f"-{i:05d}-of-{len(e.files):05d}.gguf" in f for i, f in enumerate(e.files, 1))
        if e.draft:
            d = catalog.find(e.draft)
            assert d is not None and d.family == e.family and d.size_gb < e.size_gb / 4
    for wanted in ("32b", "72b", "qwen3-32b", "70b", "27b", "glm-4.7-flash", "coder-32b", "3b", "7b", "14b"):
        assert catalog.find(wanted) is not None, wanted


def test_download_lists_the_catalog_and_unknown_names_get_suggestions(tmp_path: Path) -> None:
    env = {**os.environ, "MESH_LLM_MODELS": str(tmp_path), "COLUMNS": "80"}
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", "download"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and all(len(line) <= 80 for line in r.stdout.splitlines())
    words = set(r.stdout.replace(",", " ").split())
    for e in catalog.CATALOG:  # at 80 columns every name and alias a user may type is there, whole
        assert e.name in words and set(e.aliases) <= words, (e.name, e.aliases)
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", "download", "qwen2.5-32"], capture_output=True,
                       text=True, env=env)  # fmt: skip
    assert r.returncode == 2 and "did you mean" in r.stderr and len(r.stderr.strip().splitlines()) == 1
