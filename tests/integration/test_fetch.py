"""A node that joins with --model NAME and lacks the file fetches it from the members that serve it — several
at once, chunk by chunk, each chunk checked — and serves it; the hub (its local stand-in) sees not one request.

The mesh: a (the founder, an honest source), b (``--share off``: sends nothing) and x, whose copy of the model rotted
after it hashed it: its manifest (hashed before) is the honest one, its bytes are not — a source that sends bad
chunks. The fingerprint samples windows of each tensor, so x's copy keeps the model's fingerprint, as bit rot
between the windows would."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshllm.llama.gguf import model_fingerprint, read_header, sampled
from meshllm.proto import crypto
from meshllm.proto import fetch as core
from tests.fakes.hub_standin import HubStandin

from .meshlab import NodeProc, wait_for

NAME = "gemma-3-270m-q4_k_m"  # the name the mesh serves the tiny model under (its file's stem)


def _sha(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rotted_copy(src: Path, dest: Path, m: core.Manifest) -> None:
    """``src`` copied to ``dest`` with one byte flipped in every chunk of ``m`` that has a byte outside the header
    and the windows the model fingerprint samples (so x's copy keeps the model's fingerprint)."""
    shutil.copyfile(src, dest)
    hdr = read_header(src)
    taken = [(o, o + n) for t in hdr.tensors for o, n in sampled(t)]  # the byte ranges the fingerprint reads
    flipped = 0
    with dest.open("r+b") as f:
        for lo, n in zip(m.starts, m.lengths, strict=True):
            at = next((p for p in range(max(lo, hdr.data_offset) + 1, lo + n, 4099)
                       if not any(a <= p < b for a, b in taken)), None)  # fmt: skip
            if at is None:  # the header, or a chunk of small tensors sampled whole
                continue
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
            flipped += 1
    assert flipped >= len(m.lengths) // 2, (flipped, len(m.lengths))


def _stale_manifest(good: Path, rotted: Path, state: Path, fp: str) -> core.Manifest:
    """x's manifest cache as it was written before the rot: the honest hashes, stamped with the file as it is now
    (its size and time unchanged by the rot), so x promises the honest chunks and sends others."""
    from meshllm.serve.fetch.sharing import _manifest_of

    m = _manifest_of(good, fp, crypto.new_key(), state)  # the cache, as x wrote it of the good file
    cache = state / "manifests" / f"{fp}.json"
    d = json.loads(cache.read_text())
    st = rotted.stat()
    d["stamp"] = [st.st_size, st.st_mtime_ns]
    cache.write_text(json.dumps(d))
    return m


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandin]:
    h = HubStandin()  # knows no file: a node that asked it would fail, and it counts the asking
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, hub: HubStandin) -> Iterator[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("fetch")
    env = {"HF_ENDPOINT": hub.url}
    nodes: list[NodeProc] = []
    try:
        a = NodeProc(tmp, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024", env=env)
        nodes.append(a)
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        token = (a.state / "token").read_text().strip()
        b = NodeProc(tmp, "b", tiny_model, "--max-vram", "0.3", "--ctx-size", "1024", "--share", "off",
                     "--join", token, env=env)  # fmt: skip
        nodes.append(b)
        fp = model_fingerprint(tiny_model)
        (tmp / "x-models").mkdir()
        rotted = tmp / "x-models" / tiny_model.name
        (tmp / "x").mkdir(mode=0o700)
        m = _stale_manifest(tiny_model, tiny_model, tmp / "x", fp)
        _rotted_copy(tiny_model, rotted, m)
        assert model_fingerprint(rotted) == fp and _sha(rotted) != _sha(tiny_model)
        _stale_manifest(tiny_model, rotted, tmp / "x", fp)
        x = NodeProc(tmp, "x", rotted, "--max-vram", "0.3", "--ctx-size", "1024", "--join", token, env=env)
        nodes.append(x)
        wait_for(lambda: len(a.status().get("peers", [])) == 3, 60, "a, b and x")  # type: ignore[arg-type]
        yield {"a": a, "b": b, "x": x, "token": token, "tmp": tmp, "env": env, "fp": fp, "nodes": nodes}
    finally:
        for n in nodes:
            n.stop()


def test_a_node_without_the_file_fetches_it_from_peers_and_a_lying_one_costs_one_chunk(
    mesh: dict[str, object], tiny_model: Path, hub: HubStandin
) -> None:
    a, b, x = mesh["a"], mesh["b"], mesh["x"]
    assert isinstance(a, NodeProc) and isinstance(b, NodeProc) and isinstance(x, NodeProc)
    tmp, nodes = mesh["tmp"], mesh["nodes"]
    assert isinstance(tmp, Path) and isinstance(nodes, list)
    models = tmp / "c-models"
    c = NodeProc(tmp, "c", None, "--model", NAME, "--fetch", "all", "--models-dir", str(models), "--max-vram", "0.3",
                 "--ctx-size", "1024", "--join", str(mesh["token"]), env=mesh["env"], auto=True)  # type: ignore[arg-type]  # fmt: skip
    nodes.append(c)
    wait_for(lambda: "fetched " in c.text() or "error" in c.text(), 180, "the fetch")
    got = models / tiny_model.name
    assert got.is_file() and _sha(got) == _sha(tiny_model), c.text()[-2000:]
    assert not (models / ".partial" / f"{mesh['fp']}.part").exists()
    # x was caught at its first bad chunk and dropped (asked one chunk at a time until one proves good: it cost one
    # chunk); the file came from a
    caught = [ln for ln in c.text().splitlines() if "not the one promised" in ln]
    assert len(caught) == 1 and x.short() in caught[0], c.text()[-3000:]
    done = next(ln for ln in c.text().splitlines() if "fetched " in ln and "from the mesh in" in ln)
    assert a.short() in done and b.short() not in done, done  # b shares nothing (--share off)
    assert hub.resolves == 0  # nothing from the hub
    # it serves: a worker of the mesh with that model (the same fingerprint as the others)
    def c_is_worker() -> bool:
        me = json.loads((c.state / "status.json").read_text())["node"] if (c.state / "status.json").exists() else ""
        # a worker of the host's plan, or (with x, a node that plan leaves out too) a replica that is a split
        return any(p["node"] == me and p["role"] in ("worker", "replica") and p["model"] == mesh["fp"]
                   for p in a.status().get("peers", []))  # type: ignore[attr-defined]  # fmt: skip

    wait_for(c_is_worker, 60, "c to serve as a worker")
    # /metrics: what c fetched from each member, and what each member sent (b nothing: --share off)
    fetched = _metrics(c.port)
    assert fetched.get(f'mesh_llm_fetch_bytes_total{{peer="{a.short()}"}}', 0) > 0, fetched
    sent = _metrics(a.port)
    assert sent.get(f'mesh_llm_share_bytes_total{{peer="{c.short()}"}}', 0) > 0, sent
    assert not any(k.startswith("mesh_llm_share_bytes_total") for k in _metrics(b.port))


def _metrics(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}


def test_a_fetch_cut_by_kill_9_resumes_where_it_stopped(mesh: dict[str, object], tiny_model: Path) -> None:
    tmp, nodes = mesh["tmp"], mesh["nodes"]
    assert isinstance(tmp, Path) and isinstance(nodes, list)
    models = tmp / "e-models"
    args = ("--model", NAME, "--fetch", "all", "--models-dir", str(models), "--max-vram", "0.3", "--ctx-size", "1024")
    e = NodeProc(tmp, "e", None, *args, "--join", str(mesh["token"]), env=mesh["env"], auto=True)  # type: ignore[arg-type]
    nodes.append(e)
    have = models / ".partial" / f"{mesh['fp']}.have"

    def kept() -> int:
        try:
            return sum(len(v) for v in json.loads(have.read_text()).values())
        except (OSError, ValueError):
            return 0

    t0 = time.monotonic()
    while kept() < 4:  # the fetch runs at disk speed here: stop it the moment it has kept some chunks
        assert time.monotonic() - t0 < 120, "no chunks fetched"
        time.sleep(0.002)
    os.kill(e.proc.pid, signal.SIGSTOP)  # frozen as it is, then killed: a cut as a crash leaves it
    e.stop(signal.SIGKILL)
    n = kept()
    assert not (models / tiny_model.name).exists()
    e2 = NodeProc(tmp, "e", None, *args, env=mesh["env"], port=e.port, auto=True)  # a member now: no token
    nodes.append(e2)
    wait_for(lambda: "fetched " in e2.text() or "error" in e2.text(), 180, "the resumed fetch")
    assert "chunks kept (checked again)" in e2.text() and f": {n} of " in e2.text(), e2.text()[-2000:]
    assert _sha(models / tiny_model.name) == _sha(tiny_model)


def test_mesh_llm_download_join_fetches_without_serving(mesh: dict[str, object], tiny_model: Path,
                                                        hub: HubStandin) -> None:  # fmt: skip
    import subprocess
    import sys

    tmp = mesh["tmp"]
    assert isinstance(tmp, Path)
    r = subprocess.run([sys.executable, "-m", "meshllm.cli", "download", NAME, "--models-dir", str(tmp / "d-models")],
                       capture_output=True, text=True, timeout=180,
                       env={**os.environ, **mesh["env"], "MESH_LLM_JOIN": str(mesh["token"])})  # type: ignore[dict-item]  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert _sha(tmp / "d-models" / tiny_model.name) == _sha(tiny_model)
    assert "from the mesh in" in r.stderr and hub.resolves == 0, r.stderr[-2000:]


def test_a_model_no_member_serves_comes_from_the_hub(mesh: dict[str, object], tiny_model: Path,
                                                     hub: HubStandin) -> None:  # fmt: skip
    """The hub is the fallback: a name no member serves (here a hub reference) is downloaded, without waiting long
    once the mesh's models are known."""
    from tests.fakes.hub_standin import HubFile

    tmp, nodes = mesh["tmp"], mesh["nodes"]
    assert isinstance(tmp, Path) and isinstance(nodes, list)
    hub.files["someorg/tiny/tiny.gguf"] = HubFile(tiny_model.read_bytes())
    before = hub.resolves
    g = NodeProc(tmp, "g", None, "--model", "someorg/tiny/tiny.gguf", "--models-dir", str(tmp / "g-models"),
                 "--max-vram", "0.3", "--ctx-size", "1024", "--join", str(mesh["token"]), env=mesh["env"],
                 auto=True)  # type: ignore[arg-type]  # fmt: skip
    nodes.append(g)
    wait_for(lambda: (tmp / "g-models" / "tiny.gguf").exists() or "error" in g.text(), 120, "the download")
    assert "no member serves someorg/tiny/tiny.gguf: downloading it from the hub" in g.text(), g.text()[-2000:]
    assert hub.resolves > before and _sha(tmp / "g-models" / "tiny.gguf") == _sha(tiny_model)


def test_share_off_answers_no_request_of_any_kind(mesh: dict[str, object], tiny_model: Path) -> None:
    """(the mutation audit found only "chunk" checked it): a member with --share off answers neither a
    manifest, nor tensor samples, nor a ticket for the direct path, nor a chunk — asked over real QUIC by a member;
    the same asks of a, which shares, are answered."""
    import asyncio

    from meshllm.net.meshnet import MeshNet
    from meshllm.proto import token as tok
    from meshllm.serve.fetch.pull import ask

    a, b, tmp = mesh["a"], mesh["b"], mesh["tmp"]
    assert isinstance(a, NodeProc) and isinstance(b, NodeProc) and isinstance(tmp, Path)
    fp = str(mesh["fp"])
    state = tmp / "asker"
    state.mkdir(mode=0o700)

    async def run() -> dict[str, tuple[bool, bool]]:
        key = crypto.new_key()
        net = MeshNet(key, None, state, bind=("127.0.0.1", 0))
        await net.start()
        try:
            await net.join(tok.parse(str(mesh["token"])))
            ids = {n: crypto.node_id(n.key()) for n in (a, b)}
            for _ in range(100):
                if all(i in net.peers for i in ids.values()):
                    break
                await asyncio.sleep(0.1)
            out = {}
            for op, arg in (("manifest", 0), ("windows", [0]), ("ticket", 0), ("chunk", 0)):
                got = [await ask(net, ids[n], op, fp, arg, 64 << 20, 30.0) for n in (a, b)]
                out[op] = (bool(got[0]), bool(got[1]))  # a refusal resets the stream: no byte comes
            return out
        finally:
            await net.stop(leave=True)

    answered = asyncio.run(run())
    assert answered == {op: (True, False) for op in ("manifest", "windows", "ticket", "chunk")}, answered
