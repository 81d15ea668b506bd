"""Prometheus text exposition for GET /metrics on the API port (written by hand: a few lines of format)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    tokens_generated: int = 0
    last_tokens_per_second: float = 0.0
    elections: int = 0


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in sorted(d.items()))  # fmt: skip
    return "{" + inner + "}"


@dataclass
class Exposition:
    lines: list[str] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def metric(self, name: str, kind: str, help_: str, value: float, labels: dict[str, str] | None = None) -> None:
        if name not in self._seen:
            self._seen.add(name)
            self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self.lines.append(f"{name}{_labels(labels or {})} {value:g}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
