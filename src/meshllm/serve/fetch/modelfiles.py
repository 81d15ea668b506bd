"""The model files a node serves: the main model as given (path, catalog name, URL), its draft, and — for a node
that joined without --model — the mesh's model found on this machine by fingerprint."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import UserError
from meshllm.llama.chat import ChatDefault, chat_default
from meshllm.llama.gguf import GGUFHeader, is_embedding_model, model_fingerprint, vocab_signature
from meshllm.llama.gguf import read_header as read_gguf_header
from meshllm.models import catalog
from meshllm.models.download import installed, resolve
from meshllm.paths import models_dir
from meshllm.proto.layout import ModelShape
from meshllm.proto.record import ModelFacts


@dataclass(frozen=True)
class ModelFiles:
    """The model this node has on disk, and how it serves it."""

    path: Path
    facts: ModelFacts
    draft: Path | None = None
    chat: ChatDefault | None = None  # the chat template it gets when the GGUF has none (llama/chat.py)
    partial: bool = False  # a partial copy (only some layers): its rpc-server is told the fingerprint we checked
    embedding: bool = False  # an embedding model (llama-server in embedding mode: /v1/embeddings only)


def open_model(
    model_arg: Path, where: Path | None, draft: str | None, no_draft: bool
) -> tuple[ModelFiles, ModelShape, str | None]:
    """--model as given (a path, a catalog name, a hub reference): its file, facts, shape and draft, and a line to
    tell the user (or None). A model named by catalog name is served under that name, else under its file stem."""
    path = resolve(str(model_arg), where)
    if not path.is_file():
        raise UserError(f"--model {path}: no such file")
    hdr = read_gguf_header(path)
    shape = model_shape(hdr)
    named = path != model_arg and "/" not in str(model_arg)
    draft_path, note = choose_draft(str(model_arg), path, hdr, draft, no_draft, where)
    facts = ModelFacts(
        fingerprint=model_fingerprint(path), size=path.stat().st_size, n_layer=shape.n_layer,
        source=str(model_arg) if named else path.stem,
    )  # fmt: skip
    embedding = is_embedding_model(hdr.metadata)
    return ModelFiles(path, facts, draft_path, chat_default(hdr.metadata), embedding=embedding), shape, note


def choose_draft(
    model_arg: str | None, model: Path, hdr: GGUFHeader, draft: str | None, no_draft: bool, where: Path | None
) -> tuple[Path | None, str | None]:
    """--draft, or the catalog's paired draft when it is installed; refused if the vocabularies differ.
    Returns (the draft or None, a line to tell the user or None)."""
    if no_draft:
        return None, None
    note = None
    if draft:
        path = resolve(draft, where)
    else:
        entry = catalog.find(model_arg) if model_arg else None
        d = catalog.find(entry.draft) if entry and entry.draft else None
        found = installed(d.files[0], models_dir(where)) if d else None
        if found is None:
            return None, None
        path = found
        note = f"draft model: {d.name if d else path.name} (paired in the catalog; --no-draft)"
    if vocab_signature(read_gguf_header(path)) != vocab_signature(hdr):
        raise UserError(f"--draft {path.name}: its vocabulary differs from {model.name}'s; drafts must share it")
    return path, note


def find_by_fingerprint(where: Path, fingerprint: str, size: int) -> Path | None:
    """A GGUF file under ``where`` with this size and model fingerprint (only same-size files are hashed)."""
    if not where.is_dir():
        return None
    for path in sorted(where.rglob("*.gguf")):
        try:
            if path.stat().st_size != size:
                continue
            if model_fingerprint(path) == fingerprint:
                return path
        except (OSError, UserError):
            continue
    return None


def model_shape(hdr: GGUFHeader) -> ModelShape:
    """What the planner needs to know about a model, from its header (all parts' tensors given together): here, above
    both the file format (``llama/``) and the planner (``proto/``), which know nothing of each other."""
    arch = str(hdr.metadata.get("general.architecture", ""))

    def meta_int(key: str, default: int = 0) -> int:
        v = hdr.metadata.get(f"{arch}.{key}", default)
        return int(v) if isinstance(v, int | float) else default

    n_layer = meta_int("block_count")
    if n_layer <= 0:
        raise UserError(f"{hdr.path}: no {arch}.block_count in the model metadata")
    layer = [0] * n_layer
    experts = [0] * n_layer  # the routed experts (ffn_up/down/gate_exps; shared experts, _shexp, are not)
    embd = output = other = 0
    for t in hdr.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < n_layer:
            layer[int(m.group(1))] += t.nbytes
            if re.match(r"blk\.\d+\.ffn_(up|down|gate)_exps\.", t.name):
                experts[int(m.group(1))] += t.nbytes
        elif t.name == "token_embd.weight":
            embd = t.nbytes
        elif t.name == "output.weight":
            output = t.nbytes
        else:
            other += t.nbytes
    if output == 0:
        output = embd  # tied embeddings: llama.cpp copies the matrix to the output device
    n_embd = meta_int("embedding_length")
    n_head = max(meta_int("attention.head_count", 1), 1)
    n_head_kv = meta_int("attention.head_count_kv", n_head) or n_head
    k_len = meta_int("attention.key_length", n_embd // n_head)
    v_len = meta_int("attention.value_length", n_embd // n_head)
    vocab = hdr.metadata.get("tokenizer.ggml.tokens", 0)
    return ModelShape(
        n_layer=n_layer,
        layer_bytes=tuple(layer),
        embd_bytes=embd,
        output_bytes=output,
        other_bytes=other,
        kv_bytes_per_token_layer=2 * n_head_kv * (k_len + v_len),  # f16 K and V
        n_embd=n_embd,
        n_vocab=int(vocab) if isinstance(vocab, int) else 0,
        n_ctx_train=meta_int("context_length"),
        expert_bytes=tuple(experts) if any(experts) else (),
    )
