"""[fetch] 2: a worker that joins with ``--model NAME`` and lacks the file fetches only what the plan gives it — the
header, the bytes the model fingerprint samples of every tensor, and its own layers' chunks — into a sparse copy whose
fingerprint is the model's. The host waits for those layers, then loads the split with no weight pushed, and the
answer is the same greedy text as the same split loaded the stock way."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from meshllm.llama.build import Binaries
from meshllm.llama.gguf import layer_of, model_fingerprint, read_header, sampled
from tests.fakes.hub_standin import HubStandin

from .meshlab import NodeProc, wait_for
from .splitlab import PROMPT, stock_split_text

NAME = "gemma-3-270m-q4_k_m"  # the name the mesh serves the tiny model under (its file's stem)
N = 32
MB = 1 << 20


def _ask(port: int) -> str:
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "seed": 1, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


def _assignments(n: NodeProc) -> list[dict[str, object]]:
    p = n.status().get("plan")
    return p.get("assignments", []) if isinstance(p, dict) else []  # type: ignore[no-any-return]


def test_a_worker_fetches_only_its_layers_and_the_split_pushes_no_weight(
    tmp_path: Path, tiny_model: Path, stock_bins: Binaries
) -> None:
    hub = HubStandin()  # knows no file: nothing may come from it
    hub.start()
    env = {"HF_ENDPOINT": hub.url}
    nodes: list[NodeProc] = []
    try:
        # the host reaches its worker through the tunnel, where it counts the weight bytes it pushes
        a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.5", "--ctx-size", "1024", "--rpc-path", "tunnel",
                     env=env)  # fmt: skip
        nodes.append(a)
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        models = tmp_path / "c-models"
        c = NodeProc(tmp_path, "c", None, "--model", NAME, "--models-dir", str(models), "--max-vram", "0.3",
                     "--ctx-size", "1024", "--join", (a.state / "token").read_text().strip(), env=env,
                     auto=True)  # fmt: skip
        nodes.append(c)
        wait_for(lambda: "ready:" in a.text() and len(_assignments(a)) == 2, 180, "a to serve a split with c")
        c_id = json.loads((c.state / "status.json").read_text())["node"]
        mine = _assignments(a)[0]
        assert mine["node"] == c_id, mine
        first, count = int(mine["first"]), int(mine["count"])  # type: ignore[call-overload]
        assert "the split waits for" in a.text() and f"fetched layers {first}–{first + count - 1}" in c.text(), \
            c.text()[-2000:]  # fmt: skip
        # c holds a sparse copy: the header, the samples and its layers; never the whole file
        fp = model_fingerprint(tiny_model)
        part = models / ".partial" / f"{fp}.part"
        assert not (models / tiny_model.name).exists() and model_fingerprint(part) == fp
        hdr = read_header(tiny_model)
        layers = range(first, first + count)
        layer_bytes = sum(t.nbytes for t in hdr.tensors if layer_of(t.name) in layers)
        samples = sum(n for t in hdr.tensors if layer_of(t.name) not in layers for _, n in sampled(t))
        used = part.stat().st_blocks * 512
        print(f"\nworker's disk: {used / 1e6:.1f} MB for layers {first}-{first + count - 1} ({layer_bytes / 1e6:.1f} "
              f"MB) + header {hdr.data_offset / 1e6:.1f} MB + samples {samples / 1e6:.1f} MB; the model "
              f"{hdr.file_size / 1e6:.1f} MB")  # fmt: skip
        # each 4 KiB sample may touch two blocks; a chunk may run past its layer only to the next layer's start
        assert used <= hdr.data_offset + layer_bytes + 2 * samples + 1 * MB, used
        assert used < hdr.file_size / 2
        # the split loaded c's tensors from c's copy: no weight went over the wire, no load met a hole
        peer = next(p for p in a.status()["peers"] if p["node"] == c_id)  # type: ignore[attr-defined]
        assert peer["tunnel"]["rpc_local_loads"] > 0 and peer["tunnel"]["load_weight_bytes"] <= 1 * MB, peer
        assert "a hole" not in (c.state / "rpc-server.log").read_text()
        # the same text as the same split loaded the stock way
        text = _ask(a.port)
        counts = [float(x["count"]) for x in _assignments(a)]  # type: ignore[arg-type]
        assert stock_split_text(tmp_path / "ref", stock_bins, tiny_model, counts, N) == text
        assert _ask(c.port) == text
        assert hub.resolves == 0
        # mesh-llm status on the host names the partial copy and its layers
        r = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--port", str(a.port)], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        held = f"a partial copy of the model, holding layers {first}-{first + count - 1}"
        assert r.returncode == 0 and f"{c.short()}: {held}" in r.stdout, r.stdout
    finally:
        for n in nodes:
            n.stop()
        hub.stop()
