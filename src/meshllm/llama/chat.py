"""How a chat reaches a model whose GGUF carries no chat template of its own.

An instruction-tuned model without one gets llama.cpp's built-in template for its architecture. A base model (no
fine-tune named in its GGUF) was never taught any chat format: with its architecture's template it rambles until the
token cap (gemma-3-270m: 4,096 tokens of ``<end_of_turn>`` noise). It continues a plain transcript well instead —
"User: What is the capital of France?\\nAssistant:" → " The capital of France is Paris." — so it gets that transcript
(``transcript.jinja``) and a chat stops where the model starts writing the next turn."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# llama.cpp's built-in chat templates for architectures whose instruction-tuned GGUFs often come without one:
# llama-server would fall back to ChatML, which such models do not know (they never stop)
ARCH_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma", "phi3": "phi3",
                  "command-r": "command-r", "deepseek2": "deepseek2", "exaone": "exaone3", "granite": "granite",
                  "minicpm": "minicpm", "chatglm": "chatglm4", "qwen2": "chatml", "qwen3": "chatml"}  # fmt: skip

TRANSCRIPT = Path(__file__).with_name("transcript.jinja")
TRANSCRIPT_STOPS = ("\nUser:", "\nAssistant:")  # the transcript's turn labels: the model's answer ends before them


@dataclass(frozen=True)
class ChatDefault:
    """The chat template a model without its own gets, unless the user names one (``--chat-template``)."""

    builtin: str | None = None  # llama.cpp's built-in template for its architecture (an instruction-tuned model)
    file: Path | None = None  # a Jinja template of ours (a base model: the plain transcript)
    stops: tuple[str, ...] = ()  # stop strings every chat to it gets besides its own


BASE_MODEL = ChatDefault(file=TRANSCRIPT, stops=TRANSCRIPT_STOPS)


def chat_default(metadata: Mapping[str, object]) -> ChatDefault | None:
    """The template for a model with this GGUF metadata; None: it has its own. A model that names no fine-tune
    (``general.finetune``: "it", "Instruct", ...) is a base model; so is one whose architecture has no built-in."""
    if "tokenizer.chat_template" in metadata:
        return None
    builtin = ARCH_TEMPLATES.get(str(metadata.get("general.architecture", "")))
    if builtin and str(metadata.get("general.finetune") or "").strip():
        return ChatDefault(builtin=builtin)
    return BASE_MODEL
