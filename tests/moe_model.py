"""A small random-weight mixture-of-experts model for CPU tests — a real MoE architecture llama.cpp runs
(``qwen3moe``, the architecture of Qwen3-30B-A3B): 4 layers, 8 routed experts of which 2 fire per token, the
vocabulary and tokenizer of the pinned tree's ``models/ggml-vocab-llama-spm.gguf`` (32,000 tokens), F16 weights,
about 6 MB. Written with the ``gguf`` package, deterministic for a seed, kept in the cache once made."""

from __future__ import annotations

import hashlib
from pathlib import Path

SHAPE = {"n_layer": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 64}
VERSION = 1  # of this generator: another one writes another file


def write_tiny_moe(vocab_file: Path, out: Path, seed: int = 7) -> Path:
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    s = SHAPE
    arch = "qwen3moe"
    reader = gguf.GGUFReader(vocab_file)
    w = gguf.GGUFWriter(out, arch)
    hd = s["n_embd"] // s["n_head"]
    mine = {
        f"{arch}.block_count": s["n_layer"], f"{arch}.context_length": 4096, f"{arch}.embedding_length": s["n_embd"],
        f"{arch}.feed_forward_length": s["n_ff_exp"] * s["n_expert_used"], f"{arch}.attention.head_count": s["n_head"],
        f"{arch}.attention.head_count_kv": s["n_head_kv"], f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd, f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.expert_count": s["n_expert"],
        f"{arch}.expert_used_count": s["n_expert_used"], f"{arch}.expert_feed_forward_length": s["n_ff_exp"],
        "general.file_type": 1, "general.name": "tiny-random-qwen3moe",
    }  # fmt: skip
    for key, value in mine.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for key, field in reader.fields.items():  # the tokenizer: every tokenizer.* field as the vocab file has it
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), vtype)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())

    def t(name: str, *shape: int, scale: float = 0.1, f16: bool = True) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float16 if f16 else np.float32)
        w.add_tensor(name, data)

    e, d, x, f = s["n_embd"], hd, s["n_expert"], s["n_ff_exp"]
    t("token_embd.weight", n_vocab, e, scale=0.5)
    t("output_norm.weight", e, scale=1.0, f16=False)
    for i in range(s["n_layer"]):
        b = f"blk.{i}"
        t(f"{b}.attn_norm.weight", e, scale=1.0, f16=False)
        t(f"{b}.attn_q.weight", s["n_head"] * d, e)
        t(f"{b}.attn_k.weight", s["n_head_kv"] * d, e)
        t(f"{b}.attn_v.weight", s["n_head_kv"] * d, e)
        t(f"{b}.attn_output.weight", e, s["n_head"] * d)
        t(f"{b}.attn_q_norm.weight", d, scale=1.0, f16=False)
        t(f"{b}.attn_k_norm.weight", d, scale=1.0, f16=False)
        t(f"{b}.ffn_norm.weight", e, scale=1.0, f16=False)
        t(f"{b}.ffn_gate_inp.weight", x, e, scale=1.0, f16=False)
        t(f"{b}.ffn_gate_exps.weight", x, f, e)
        t(f"{b}.ffn_down_exps.weight", x, e, f)
        t(f"{b}.ffn_up_exps.weight", x, f, e)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tiny_moe_path() -> Path:
    """The tiny MoE model in the cache (made once per generator version and vocabulary)."""
    from meshllm.llama.source import fetch_pinned_source
    from meshllm.paths import cache_dir

    vocab = fetch_pinned_source(say=lambda line: None) / "models" / "ggml-vocab-llama-spm.gguf"
    tag = hashlib.sha256(f"{VERSION}{SHAPE}".encode() + vocab.read_bytes()).hexdigest()[:12]
    out = cache_dir() / "models" / f"tiny-qwen3moe-{tag}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_tiny_moe(vocab, tmp)
        tmp.replace(out)
    return out
