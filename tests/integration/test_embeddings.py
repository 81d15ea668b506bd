"""/v1/embeddings where the mesh serves an embedding model — llama-server's embedding mode on the node that
hosts it, the same vectors through a lite client — and a clear 400 for the wrong kind of request either way.

The embedding model is made for the test: the tiny model with a pooling type in its metadata (``gemma3.pooling_type``
= 1, mean), which llama.cpp reads for any architecture; real embedding models (BERT-likes, Qwen3-Embedding) carry
the same key. Real binaries, real nodes, loopback."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshllm.llama.build import Binaries
from meshllm.llama.processes import Child, free_port, wait_http_ready

from .meshlab import NodeProc, wait_for
from .test_serve_split import _health

TEXTS = ["The quick brown fox", "jumps over the lazy dog"]


@pytest.fixture(scope="module")
def embd_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out = tmp_path_factory.mktemp("embd") / "tiny-embd.gguf"
    reader = gguf.GGUFReader(tiny_model)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {f"{arch}.pooling_type": MetadataDetails(gguf.GGUFValueType.UINT32, 1)}, [])
    return out


def _post(port: int, path: str, body: dict[str, object], key: str | None = None) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _vectors(answer: dict[str, object]) -> list[list[float]]:
    data = answer["data"]
    assert isinstance(data, list)
    return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]


@pytest.fixture(scope="module")
def mesh(embd_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProc]]:
    """``e`` serves the embedding model, ``c`` is a lite client of its mesh, ``t`` serves the tiny text model alone."""
    tmp = tmp_path_factory.mktemp("embd-mesh")
    e = NodeProc(tmp, "e", embd_model, "--ctx-size", "512", "--parallel", "1")
    nodes = {"e": e}
    try:
        wait_for(lambda: (e.state / "token").exists(), 30, "e's token")
        nodes["c"] = NodeProc(tmp, "c", None, env={"MESH_LLM_JOIN": (e.state / "token").read_text().strip()})
        from meshllm.models.tiny import tiny_model_path

        nodes["t"] = NodeProc(tmp, "t", tiny_model_path(), "--ctx-size", "512")
        for n in (e, nodes["t"]):
            wait_for(lambda n=n: "ready:" in n.text() or n.proc.poll() is not None, 120, f"{n.state.name} ready")
            assert n.proc.poll() is None, n.text()[-3000:]
        wait_for(lambda: _health(nodes["c"].port) == 200, 60, "the lite client to answer")
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()


def test_an_embedding_model_answers_embeddings_as_llama_server_does_on_every_node(
    mesh: dict[str, NodeProc], embd_model: Path, patched_bins: Binaries, tmp_path: Path
) -> None:
    e, c = mesh["e"], mesh["c"]
    status, got = _post(e.port, "/v1/embeddings", {"input": TEXTS})
    assert status == 200, got
    here = _vectors(got)
    assert len(here) == 2 and all(len(v) == 640 for v in here), [len(v) for v in here]
    assert got["object"] == "list" and got["model"], got
    # through the lite client (the host's door) and under the bare path: the same vectors
    wait_for(lambda: _post(c.port, "/v1/embeddings", {"input": TEXTS[0]})[0] == 200, 60, "the client to route it")
    assert _vectors(_post(c.port, "/v1/embeddings", {"input": TEXTS})[1]) == here
    assert _vectors(_post(e.port, "/embeddings", {"input": TEXTS})[1]) == here
    # llama-server alone on the same file in its embedding mode, with the node's one slot of 512 tokens (its vectors
    # differ by up to 0.1 between its own slot layouts: --parallel 4 against 1 here): the same vectors
    port = free_port()
    argv = [str(patched_bins.llama_server), "--host", "127.0.0.1", "--port", str(port), "--model", str(embd_model),
            "--embeddings", "--ctx-size", "512", "--parallel", "1", "--threads", "2"]  # fmt: skip
    with Child.start("llama-embd", argv, tmp_path / "llama.log") as direct:
        wait_http_ready(direct, f"http://127.0.0.1:{port}/health", 120)
        alone = _vectors(_post(port, "/v1/embeddings", {"input": TEXTS})[1])
    for a, b in zip(here, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3
    assert abs(math.fsum(x * x for x in here[0]) - 1.0) < 1e-3  # llama-server's normalised vectors, as alone
    # an embedding request needs its input
    status, err = _post(e.port, "/v1/embeddings", {"model": "x"})
    assert status == 400 and err["error"]["param"] == "input", err  # type: ignore[index]


def test_the_wrong_kind_of_request_gets_a_clear_400_on_every_node(mesh: dict[str, NodeProc]) -> None:
    e, c, t = mesh["e"], mesh["c"], mesh["t"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for node in (e, c):  # text from an embedding model: here and through the host's door
        status, err = _post(node.port, "/v1/chat/completions", chat)
        assert status == 400, err
        assert "is an embedding model: it answers /v1/embeddings only" in err["error"]["message"], err  # type: ignore[index]
        assert err["error"]["code"] == "model_not_supported", err  # type: ignore[index]
    status, err = _post(t.port, "/v1/embeddings", {"input": "Hi"})  # embeddings from a model that makes text
    assert status == 400, err
    assert "makes text, not embeddings" in err["error"]["message"], err  # type: ignore[index]
    assert _post(t.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
