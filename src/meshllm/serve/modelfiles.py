"""The model files a node serves: the main model as given (path, catalog name, URL), its draft, and — for a node
that joined without --model — the mesh's model found on this machine by fingerprint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import UserError
from meshllm.llama.chat import ChatDefault, chat_default
from meshllm.llama.gguf import GGUFHeader, model_fingerprint, model_shape, vocab_signature
from meshllm.llama.gguf import read_header as read_gguf_header
from meshllm.models import catalog
from meshllm.models.download import installed, resolve
from meshllm.paths import models_dir
from meshllm.proto.gossip import ModelFacts
from meshllm.proto.planner import ModelShape


@dataclass(frozen=True)
class ModelFiles:
    """The model this node has on disk, and how it serves it."""

    path: Path
    facts: ModelFacts
    draft: Path | None = None
    chat: ChatDefault | None = None  # the chat template it gets when the GGUF has none (llama/chat.py)
    partial: bool = False  # a partial copy (only some layers): its rpc-server is told the fingerprint we checked


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
    return ModelFiles(path, facts, draft_path, chat_default(hdr.metadata)), shape, note


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
