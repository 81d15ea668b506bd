"""Load generators for the benchmarks: streamed completions from many clients at once (aggregate generated tokens
per wall second, each request's time to first token) and long prompts' prefill (llama-server's own prompt timing).
Standard library only, so it runs on the lent GPU machine as it is."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request


def ids(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids (the random model reads any), different for every seed: no prompt cache helps."""
    import random

    r = random.Random(seed)
    return [r.randrange(1000, 100000) for _ in range(n)]


def one(base: str, path: str, prompt: list[int], tokens: int) -> tuple[float, float, int]:
    """One streamed completion: (seconds to its first token, seconds in all, tokens generated)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "stream": True}  # fmt: skip
    t0 = time.monotonic()
    c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()[:300]
    first, n = 0.0, 0
    for line in r:
        if line.startswith(b"data: {") and b'"text"' in line:
            n += 1
            first = first or time.monotonic() - t0
    c.close()
    return first, time.monotonic() - t0, n


def concurrent(base: str | list[str], path: str, clients: int, tokens: int, runs: int, seed: int
               ) -> tuple[float, list[float]]:  # fmt: skip
    """``clients`` streams at once, ``runs`` times: (median aggregate tok/s, every request's time to first token).
    Several ``base`` URLs: client i asks the i-th in turn (servers the clients themselves share out)."""
    from concurrent.futures import ThreadPoolExecutor

    bases = [base] if isinstance(base, str) else base
    aggs, ttfts = [], []
    for run in range(runs):
        prompts = [(bases[i % len(bases)], ids(32, seed + 1000 * run + i)) for i in range(clients)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(clients) as ex:
            got = list(ex.map(lambda bp: one(bp[0], path, bp[1], tokens), prompts))
        wall = time.monotonic() - t0
        aggs.append(sum(g[2] for g in got) / wall)
        ttfts += [g[0] for g in got]
    return statistics.median(aggs), ttfts


def prefill(base: str, path: str, n: int, runs: int, seed: int) -> float:
    """Prompt tok/s of an ``n``-token prompt (llama-server's own prompt timing), the median of ``runs``."""
    out = []
    for run in range(runs):
        body = {"prompt": ids(n, seed + run), "max_tokens": 1, "cache_prompt": False, "temperature": 0}
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            t = json.loads(r.read())["timings"]
        out.append(1000.0 * t["prompt_n"] / t["prompt_ms"])
    return statistics.median(out)


def greedy_digest(base: str, path: str, n: int, tokens: int, seed: int) -> str:
    """The first 8 hex digits of the SHA-256 of ``tokens`` greedy tokens after an ``n``-token prompt (several
    micro-batches of it: the pipelined prefill's result is in the text): equal digests, the same text."""
    import hashlib

    body = {"prompt": ids(n, seed), "max_tokens": tokens, "cache_prompt": False, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def wait_until(pred: object, timeout: float, what: str, every: float = 0.2) -> None:
    """Poll ``pred`` until it holds; SystemExit naming ``what`` after ``timeout`` seconds."""
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(every)


PROMPT = "Once upon a time, in a land far away,"


def tps(base: str, path: str, tokens: int, runs: int) -> float:
    def once(n: int) -> float:
        body = {"prompt": PROMPT, "n_predict": n, "max_tokens": n, "temperature": 0, "cache_prompt": False,
                "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return float(json.loads(r.read())["timings"]["predicted_per_second"])

    once(8)
    return statistics.median(once(tokens) for _ in range(runs))
