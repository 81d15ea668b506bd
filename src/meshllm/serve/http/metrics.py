"""Prometheus text exposition (format 0.0.4) for GET /metrics on the API port, written by hand: each family once
(HELP, TYPE, then all its samples together), base units (seconds, bytes), counters as exact integers."""

from __future__ import annotations

from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Cumulative buckets (seconds), a sum and a count: what Prometheus' histogram_quantile() takes."""

    buckets: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_S))
    total: float = 0.0
    n: int = 0
    last: float | None = None

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += v
        self.n += 1
        self.last = v

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (None before any observation)."""
        if not self.n:
            return None
        return next((b for b, c in zip(self.buckets, self.counts, strict=True) if c >= q * self.n), float("inf"))


@dataclass
class Counters:
    tokens_generated: int = 0
    decode_seconds: float = 0.0  # llama-server's own decode time of those tokens: rate(tokens) / rate(seconds)
    last_tokens_per_second: float = 0.0
    elections: int = 0
    duration: Histogram = field(default_factory=Histogram)  # completion requests through this node's API
    ttft: Histogram = field(default_factory=Histogram)  # from the request to its first generated token


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in sorted(d.items()))  # fmt: skip
    return "{" + inner + "}"


def _value(v: float) -> str:
    """Exact: an integral value as an integer (``%g`` made 183804123 "1.83804e+08"), else Python's shortest repr."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**63 else repr(float(v))


@dataclass
class Exposition:
    families: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)  # name -> (kind, help, samples)

    def metric(self, name: str, kind: str, help_: str, value: float, labels: dict[str, str] | None = None) -> None:
        fam = self.families.setdefault(name, (kind, help_, []))
        fam[2].append(f"{name}{_labels(labels or {})} {_value(value)}")

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        samples = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(h.buckets, h.counts, strict=True)]
        samples += [f'{name}_bucket{{le="+Inf"}} {h.n}', f"{name}_sum {_value(h.total)}", f"{name}_count {h.n}"]
        self.families[name] = ("histogram", help_, samples)

    def text(self) -> str:
        lines = []
        for name, (kind, help_, samples) in self.families.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(lines) + "\n"
