"""Speculative decoding through mesh-llm: the tiny model solo, without and with itself as the draft.

    .venv/bin/python benchmarks/draft_speedup.py [--runs 5] [--tokens 128]

A model drafting for itself accepts every drafted token, so this shows the plumbing's ceiling on this machine,
not what a real pair gains (for that: a 32B model with its 0.5B draft on a GPU; the seeds saw +17% on prose and
+38% on code at 20 ms RTT). Decode speed is llama-server's own timing, median of --runs greedy completions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import header  # benchmarks/common.py: the command line and machine
from tests.integration.meshlab import NodeProc, wait_for

from meshllm.models.tiny import tiny_model_path

PROMPTS = {"code": "def quicksort(items):\n", "prose": "The history of the lighthouse begins"}


def tps(port: int, prompt: str, n: int) -> float:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return float(json.loads(r.read())["timings"]["predicted_per_second"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    header()
    model = tiny_model_path()
    res: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="mesh-llm-bench-") as tmpd:
        for label, extra in (("no draft", ["--no-draft"]), ("self-draft, 8", ["--draft", str(model)])):
            n = NodeProc(Path(tmpd), label.replace(" ", "_").replace(",", ""), model, "--ctx-size", "2048", *extra)
            try:
                wait_for(lambda n=n: "ready:" in n.text(), 120, "ready")
                tps(n.port, "warm up", 8)
                for kind, prompt in PROMPTS.items():
                    res[(label, kind)] = statistics.median(tps(n.port, prompt, args.tokens) for _ in range(args.runs))
            finally:
                n.stop()
    print(f"tiny model solo, {args.tokens} tokens greedy, median of {args.runs} runs\n")
    print("| prompt | no draft tok/s | self-draft tok/s | ratio |\n|---|---:|---:|---:|")
    for kind in PROMPTS:
        a, b = res[("no draft", kind)], res[("self-draft, 8", kind)]
        print(f"| {kind} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
