"""Small GGUF files for unit tests, written with the ``gguf`` package: a "llama" model of ``layers`` layers, each of
two f32 tensors, and a token embedding and an output norm outside the layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def write_gguf(path: Path, layers: int = 4, floats: int = 40_000, seed: int = 0) -> Path:
    """A GGUF file whose tensors hold random floats (``floats`` per layer tensor: 160 KB, past the fingerprint's
    64 KiB, so it samples windows of them)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", rng.random((100, 64), dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.random(floats, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.random(64, dtype=np.float32))
    w.add_tensor("output_norm.weight", rng.random(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
