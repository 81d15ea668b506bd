"""A running node's terminal: every line it prints — its own narration and its loggers' — in one format, the time
first ("13:40:01 ready: http://…"). Before, rich lines without a time sat beside logging's "2026-11-27 13:40:01,234
INFO meshllm.hosting: …" lines."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from rich.console import Console
from rich.text import Text


class Terminal(Console):
    """A rich Console whose every print starts with the time of day; with ``log`` (a file-like object), each line
    also goes there as plain text (``mesh-llm logs`` reads it: machine/registry.py)."""

    def __init__(self, *args: Any, log: Any = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.to_log = Console(file=log, color_system=None, highlight=False, soft_wrap=True, width=200) if log else None

    def print(self, *objects: Any, **kw: Any) -> None:
        stamp = Text(time.strftime("%H:%M:%S"), style="dim")
        super().print(stamp, *objects, **kw)
        if self.to_log is not None:
            with contextlib.suppress(Exception):  # a full disk must not take the node down
                self.to_log.print(stamp, *objects, **kw)


class ToTerminal(logging.Handler):
    """Log records as the terminal's lines: "TIME hosting: text", warnings and errors saying so, in colour."""

    def __init__(self, term: Console) -> None:
        super().__init__()
        self.term = term

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
            text = f"{record.name.removeprefix('meshllm.')}: {level}{record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            style = "red" if record.levelno >= logging.ERROR else "yellow" if record.levelno >= logging.WARNING else ""
            self.term.print(Text(text, style=style))
        except Exception:  # a log line must never take the node down
            self.handleError(record)


def terminal_for_node(verbose: bool, log: Any = None) -> Terminal:
    """The node's terminal (stderr), with every logger writing to it (and, with ``log``, to that file too)."""
    term = Terminal(stderr=True, highlight=False, soft_wrap=True, log=log)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(ToTerminal(term))
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    return term
