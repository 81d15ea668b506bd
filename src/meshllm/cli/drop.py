"""``mesh-llm drop NAME`` (the founder or an admin): ask the whole mesh to stop serving a model; ``mesh-llm serve
NAME`` brings it back (``machine/words.direct``; the command is ``serve.py``'s, the other way)."""

from __future__ import annotations

from typing import Any

from meshllm.cli.serve import add_word


def add(sub: Any) -> None:
    add_word(sub, "drop", "stop serving a model", serve=False)
