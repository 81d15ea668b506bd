"""[models] Downloads against the local hub stand-in (FAKE: tests/fakes/hub_standin.py), and model names."""

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


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandin]:
    h = HubStandin()
    h.start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", h.url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", h.url + "/{repo_id}/resolve/{revision}/{filename}")
    yield h


def test_fresh_download_is_verified(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA)
    p = download_file("org/repo", "m.gguf", tmp_path)
    assert p == tmp_path / "m.gguf" and p.read_bytes() == DATA
    gets = hub.files["org/repo/m.gguf"].gets
    assert download_file("org/repo", "m.gguf", tmp_path) == p and hub.files["org/repo/m.gguf"].gets == gets


def test_resume_after_the_connection_drops(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA, cut_once=True)
    try:
        p = download_file("org/repo", "m.gguf", tmp_path)
    except UserError:
        assert not (tmp_path / "m.gguf").exists(), "a half file under the final name"
        p = download_file("org/repo", "m.gguf", tmp_path)  # run again: it resumes
    assert p.read_bytes() == DATA


def test_corrupted_bytes_are_refused_and_refetched(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA, corrupt_once=True)
    p = download_file("org/repo", "m.gguf", tmp_path)
    assert p.read_bytes() == DATA and hub.files["org/repo/m.gguf"].gets == 2


def test_404_and_401_are_one_clear_line(hub: HubStandin, tmp_path: Path) -> None:
    hub.files["org/repo/m.gguf"] = HubFile(DATA)
    with pytest.raises(UserError, match=r"not found on the hub \(404\)"):
        download_file("org/repo", "other.gguf", tmp_path)
    with pytest.raises(UserError, match=r"not found on the hub \(404\)"):
        download_file("org/none", "m.gguf", tmp_path)
    hub.gated.add("org/gated")
    with pytest.raises(UserError, match="HF_TOKEN"):
        download_file("org/gated", "m.gguf", tmp_path)


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
    env = {**os.environ, "MESH_LLM_MODELS": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", "download"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "qwen2.5-32b" in r.stdout and "installed" in r.stdout
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", "download", "qwen2.5-32"], capture_output=True,
                       text=True, env=env)  # fmt: skip
    assert r.returncode == 2 and "did you mean" in r.stderr and len(r.stderr.strip().splitlines()) == 1
