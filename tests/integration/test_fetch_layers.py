"""A worker that joins with ``--model NAME`` and lacks the file fetches only what the plan gives it — the
header, the bytes the model fingerprint samples of every tensor, and its own layers' chunks — into a sparse copy whose
fingerprint is the model's. The host waits for those layers, then loads the split with no weight pushed, and the
answer is the same greedy text as the same split loaded the stock way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from meshllm.llama.build import Binaries
from meshllm.llama.gguf import held_with_layer, model_fingerprint, read_header
from tests.fakes.hub_standin import HubStandin

from .meshlab import NodeProc, in_process_source, serves, wait_for
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
        a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024", "--rpc-path", "tunnel",
                     env=env)  # fmt: skip
        nodes.append(a)
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        models = tmp_path / "c-models"
        c = NodeProc(tmp_path, "c", None, "--model", NAME, "--models-dir", str(models), "--max-vram", "0.3",
                     "--ctx-size", "1024", "--join", (a.state / "token").read_text().strip(), env=env,
                     auto=True)  # fmt: skip
        nodes.append(c)

        def c_partial() -> bool:  # a holds c's record: a partial copy with no layer yet (it fetches once planned)
            return any(p.get("held") == [] for p in a.status().get("peers", []))  # type: ignore[attr-defined]

        wait_for(c_partial, 60, "c's partial copy", every=0.02)
        # c frozen before it adopts the plan (2 s after its record): the host must wait for c's layers, not load
        # the split and push them; 4 s is short of a direct peer's death (6 s)
        os.kill(c.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: "the split waits for" in a.text(), 4, "the host to wait for c's layers")
            assert "ready:" not in a.text()
        finally:
            os.kill(c.proc.pid, signal.SIGCONT)
        wait_for(lambda: serves(a, 2), 180, "a to serve a split with c")
        c_id = json.loads((c.state / "status.json").read_text())["node"]
        mine = _assignments(a)[0]
        assert mine["node"] == c_id, mine
        first, count = int(mine["first"]), int(mine["count"])  # type: ignore[call-overload]
        assert f"fetched layers {first}–{first + count - 1}" in c.text(), c.text()[-2000:]
        # c holds a sparse copy: the header, the samples and its layers; never the whole file
        fp = model_fingerprint(tiny_model)
        part = models / ".partial" / f"{fp}.part"
        assert not (models / tiny_model.name).exists() and part.stat().st_size == tiny_model.stat().st_size
        hdr = read_header(tiny_model)
        layers = range(first, first + count)
        layer_bytes = sum(t.nbytes for t in hdr.tensors if held_with_layer(t.name) in layers)  # + the embedding
        used = part.stat().st_blocks * 512
        print(f"\nworker's disk: {used / 1e6:.1f} MB for layers {first}-{first + count - 1} ({layer_bytes / 1e6:.1f} "
              f"MB) + header {hdr.data_offset / 1e6:.1f} MB; the model {hdr.file_size / 1e6:.1f} MB")  # fmt: skip
        # the tensors' sampled bytes were checked (the fingerprint) in memory, never written: its layers' chunks
        # (they start where a layer starts) and the header are all it holds
        assert used <= (hdr.data_offset + layer_bytes) * 1.05, used
        assert f"{fp} (as given: a partial copy)" in (c.state / "rpc-server.log").read_text()
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
        # c killed -9 and started again (a member now: no token): its copy is kept (checked again), no layer is
        # fetched anew, and the split serves the same text
        c.stop(signal.SIGKILL)
        nodes.remove(c)
        c2 = NodeProc(tmp_path, "c", None, "--model", NAME, "--models-dir", str(models), "--max-vram", "0.3",
                      "--ctx-size", "1024", env=env, port=c.port, auto=True)  # fmt: skip
        nodes.append(c2)
        wait_for(lambda: "API up" in c2.text() or "ready" in c2.text(), 120, "c back in the split")

        def answers() -> bool:
            try:
                return _ask(a.port) == text
            except OSError:
                return False

        wait_for(answers, 120, "the split to answer again")
        assert "fetched layers" not in c2.text() and "the header of" in c2.text(), c2.text()[-2000:]
    finally:
        for n in nodes:
            n.stop()
        hub.stop()


def test_a_source_that_lies_about_the_sampled_bytes_is_dropped_and_the_copy_completes(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A member that signs the honest manifest but sends other sampled bytes (its own code, not mesh-llm's: here an
    in-process member over real QUIC) is caught at its first bad tensor and asked nothing more; the partial copy
    completes from the honest source, with the model's fingerprint."""
    import contextlib

    from meshllm.proto import crypto
    from meshllm.proto import token as tok
    from meshllm.proto.record import ModelFacts
    from meshllm.serve.fetch.sharing import Sharing

    class Lying(Sharing):
        async def windows(self, peer: bytes, fp: str, path: Path, which: object) -> bytes | None:
            data = await super().windows(peer, fp, path, which)
            return bytes([data[0] ^ 0xFF]) + data[1:] if data else data

    nodes: list[NodeProc] = []
    sources = contextlib.ExitStack()
    try:
        a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024")
        nodes.append(a)
        wait_for(lambda: (a.state / "token").exists() and (a.state / "status.json").exists(), 30, "a's token")
        a_id = bytes.fromhex(json.loads((a.state / "status.json").read_text())["node"])
        key = next(k for k in iter(crypto.new_key, None) if crypto.node_id(k) < a_id)  # sorts first: asked first
        token = tok.parse((a.state / "token").read_text().strip())
        fp = model_fingerprint(tiny_model)
        facts = ModelFacts(fp, tiny_model.stat().st_size, 18, NAME)
        state = tmp_path / "liar"
        state.mkdir(mode=0o700)

        sources.enter_context(in_process_source(key, state, token, Lying(key, state, lambda: {fp: tiny_model}),
                                                facts, "liar"))  # fmt: skip
        wait_for(lambda: any(p.get("name") == "liar" for p in a.status().get("peers", [])), 30,  # type: ignore[attr-defined]
                 "a to know the liar")  # fmt: skip
        models = tmp_path / "c-models"
        c = NodeProc(tmp_path, "c", None, "--model", NAME, "--models-dir", str(models), "--max-vram", "0.3",
                     "--ctx-size", "1024", "--join", (a.state / "token").read_text().strip(), auto=True)  # fmt: skip
        nodes.append(c)
        wait_for(lambda: serves(a, 2), 180, "a to serve a split with c")
        caught = [ln for ln in c.text().splitlines() if "sent tensor samples that are not the ones promised" in ln]
        assert len(caught) == 1 and crypto.short(crypto.node_id(key)) in caught[0], c.text()[-3000:]
        assert f"{fp} (as given: a partial copy)" in (c.state / "rpc-server.log").read_text()
        assert _ask(a.port).strip()
    finally:
        sources.close()
        for n in nodes:
            n.stop()


def test_a_partial_copy_gives_back_the_layers_a_plan_took_away(tmp_path: Path, tiny_model: Path) -> None:
    """Layers a stable plan no longer gives a worker are given back — holes punched in its sparse copy
    (the disk freed, the file's size kept), the chunks forgotten in ``.have`` — and the layers it keeps are intact."""
    from meshllm.proto import crypto
    from meshllm.serve.fetch.modelfiles import model_shape
    from meshllm.serve.fetch.pull import PartialCopy, _resume
    from meshllm.serve.fetch.sharing import _manifest_of

    fp = model_fingerprint(tiny_model)
    m = _manifest_of(tiny_model, fp, crypto.new_key(), tmp_path / "state")
    part, have_file = tmp_path / f"{fp}.part", tmp_path / f"{fp}.have"
    part.write_bytes(tiny_model.read_bytes())
    hdr = read_header(part)
    copy = PartialCopy(None, m, [], part, have_file, hdr, set(range(len(m.chunks))), "tiny")  # type: ignore[arg-type]
    n = model_shape(hdr).n_layer
    assert copy.held() == ((0, n),)
    blocks = part.stat().st_blocks * 512
    given = copy.give_back({3, 4, 5})
    assert given > 0 and copy.held() == ((3, 3),)
    assert blocks - part.stat().st_blocks * 512 >= given * 0.95  # the disk is freed (4 KiB blocks at the edges)
    assert part.stat().st_size == tiny_model.stat().st_size
    kept = copy.chunks_of({3, 4, 5}) | {0}
    assert kept <= copy.have and _resume(part, have_file, m) == copy.have  # what a restart keeps, checked again
    assert copy.give_back({3, 4, 5}) == 0  # nothing more to give
