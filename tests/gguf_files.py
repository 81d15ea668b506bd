"""GGUF files for tests: small ones written with the ``gguf`` package (a "llama" model of ``layers`` layers, each of
two f32 tensors, and a token embedding and an output norm outside the layers), and a runnable model with other
weights made from the tiny one."""

from __future__ import annotations

import shutil
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


def altered_copy(model: Path, out: Path) -> Path:
    """``model`` with one tensor's data replaced by another's of the same type and shape (``blk.12.ffn_up.weight``
    by ``blk.3.ffn_up.weight``): the same names, shapes and metadata, other weights, as a fine-tune would be — another
    fingerprint, still a model that runs."""
    from meshllm.llama.gguf import read_header

    by_name = {t.name: t for t in read_header(model).tensors}
    dst, src = by_name["blk.12.ffn_up.weight"], by_name["blk.3.ffn_up.weight"]
    assert (dst.ggml_type, dst.shape, dst.nbytes) == (src.ggml_type, src.shape, src.nbytes)
    shutil.copyfile(model, out)
    with out.open("r+b") as f:
        f.seek(src.offset)
        data = f.read(src.nbytes)
        f.seek(dst.offset)
        f.write(data)
    return out
