#!/usr/bin/env python3
"""Can a cut answer go on after one prefill and still be the uninterrupted text? For each prompt and
each cut point k (tokens sent before the cut) of its greedy answer, two continuations in one prefill each:

- text: the prompt extended by the k tokens' text (what ``proto/resume.continuation`` sends; the text is tokenized
  again, with the prompt);
- ids: the prompt's text, then the k generated token ids (llama-server's mixed prompt: nothing is tokenized again).

Each is compared with the uninterrupted answer to its end. Printed beside: the seconds to the first new token,
against generating the k tokens again one by one (what the API does today: ``proto/resume.Replay``).

    python3 benchmarks/resume_seam.py [--tokens 96] [--every 12]

One llama-server (the patched build, CPU) with the tiny model: the same server before and after the cut, so a
difference is the prefill's arithmetic or the tokenization, not another machine's numerics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header  # benchmarks/common.py: the command line and machine

from meshllm.llama.build import find_binaries
from meshllm.llama.processes import Child, free_port, llama_server_argv, wait_http_ready
from meshllm.models.tiny import tiny_model_path

PROMPTS = [
    "Count from one to forty: 1, 2, 3,",
    "Once upon a time",
    "Here is a short story about a lighthouse keeper:",
    "The three most important rules of distributed systems are",
]


def stream(port: int, prompt: Any, n: int, mark: int) -> tuple[str, list[int], float]:
    """llama-server's own streamed completion: the text, the token ids, and the seconds to the ``mark``-th token."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": True, "cache_prompt": False,
            "return_tokens": True}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    text, ids, at = "", [], 0.0
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                text += ev.get("content") or ""
                ids += ev.get("tokens") or []
                if not at and len(ids) >= mark:
                    at = time.monotonic() - t0
    return text, ids, at or time.monotonic() - t0


def detok(port: int, ids: list[int]) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/detokenize", json.dumps({"tokens": ids}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return str(json.loads(r.read())["content"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96, help="tokens of each uninterrupted answer")
    ap.add_argument("--every", type=int, default=12, help="a cut point every this many tokens")
    args = ap.parse_args()
    header()
    bins, model, port = find_binaries(), tiny_model_path(), free_port()
    argv = llama_server_argv(bins, model, port, ctx_size=1024, threads=2)
    with tempfile.TemporaryDirectory() as tmp, Child.start("llama-server", argv, Path(tmp) / "llama.log") as child:
        wait_http_ready(child, f"http://127.0.0.1:{port}/health", 300)
        print(f"\nthe tiny model, llama-server alone (CPU, 2 threads); a cut every {args.every} tokens of a "
              f"{args.tokens}-token greedy answer; the uninterrupted text to the end, of the cut points\n")  # fmt: skip
        print("| prompt | cut points | text: same | ids: same | s to the first new token: one prefill | token by "
              "token |\n|---|---:|---:|---:|---:|---:|")
        for prompt in PROMPTS:
            whole, ids, _ = stream(port, prompt, args.tokens, 1)
            cuts = list(range(args.every, len(ids), args.every))
            same_text = same_ids = 0
            fast, slow = [], []
            for k in cuts:
                sent = detok(port, ids[:k])
                if not whole.startswith(sent):
                    continue  # a cut inside a character: the client has bytes of it (not a cut the API makes)
                rest, _, _ = stream(port, prompt + sent, args.tokens - k, 1)
                same_text += int(sent + rest == whole)
                rest, _, s = stream(port, [prompt, *ids[:k]], args.tokens - k, 1)
                same_ids += int(sent + rest == whole)
                fast.append(s)
                _, _, s = stream(port, prompt, k + 1, k + 1)
                slow.append(s)
            print(f"| {prompt[:40]!r} | {len(fast)} | {same_text} | {same_ids} | {statistics.median(fast):.2f} | "
                  f"{statistics.median(slow):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
