"""`mesh-llm plan MODEL` — the host the election would pick, each node's layers and memory, the slots; or
what the mesh lacks. From a node's status (pure), without loading anything."""

from __future__ import annotations

from meshllm.proto.layout import GB, MiB, ModelShape
from meshllm.proto.sizing import size
from meshllm.serve.preview import describe, mesh_slots

SHAPE = ModelShape(
    n_layer=10, layer_bytes=(100 * MiB,) * 10, embd_bytes=200 * MiB, output_bytes=200 * MiB, other_bytes=MiB,
    kv_bytes_per_token_layer=1024, n_embd=1024, n_vocab=32000,
)  # fmt: skip


def _peer(i: int, cap: float, scope: str = "host", role: str = "worker") -> dict[str, object]:
    return {"node": f"{i:02x}" * 32, "short": f"{i:02x}" * 4, "name": f"n{i}", "scope": scope, "role": role,
            "capacity": int(cap * GB), "device": "cpu", "rtt_ms": 1.0}  # fmt: skip


def test_the_host_is_the_elected_one_and_only_members_that_may_serve_count() -> None:
    status = {"node": "01" * 32, "peers": [_peer(1, 1.0), _peer(2, 0.6, "worker"), _peer(3, 9.0, "client"),
                                           _peer(4, 9.0, role="client"), _peer(5, 0.2)]}  # fmt: skip
    found = mesh_slots(status)
    assert found is not None
    host, others, labels = found
    assert host.node == bytes([1]) * 32  # most memory among host-scoped (the client-scoped 9 GB is no candidate)
    assert {s.node[0] for s in others} == {2, 5} and [s.prompts for s in others] == [False, True]
    got = size(SHAPE, host, others, 1, 1024)
    lines = describe("m.gguf", SHAPE, 1_300_000_000, got, labels, "the mesh")
    assert lines[0] == "m.gguf (1.30 GB, 10 layers) on the mesh:"
    assert any(ln.startswith("  host   01010101 \"n1\"") and "+ output" in ln for ln in lines), lines
    assert any(ln.startswith("  worker 02020202 \"n2\" (cpu, 0.6 GB offered): layers 0–") for ln in lines), lines
    assert lines[-1] == "  slots: 1 × 1024 tokens of context"
    assert mesh_slots({"peers": [_peer(2, 5.0, "worker")]}) is None  # nobody may host


def test_a_mesh_short_of_memory_says_how_much() -> None:
    found = mesh_slots({"node": "01" * 32, "peers": [_peer(1, 0.5), _peer(2, 0.2, "worker")]})
    assert found is not None
    host, others, labels = found
    lines = describe("m.gguf", SHAPE, 1_300_000_000, size(SHAPE, host, others, 1, 1024), labels, "the mesh")
    assert lines[1].startswith("  would not load: waiting for more peers — need ") and "have 0.7 GB" in lines[1]
    tiny = mesh_slots({"node": "01" * 32, "peers": [_peer(1, 0.3), _peer(2, 2.0, "worker")]})
    assert tiny is not None  # a host that cannot hold the output says so, never a plan over its cap
    lines = describe("m.gguf", SHAPE, 1_300_000_000, size(SHAPE, tiny[0], tiny[1], 1, 1024), tiny[2], "the mesh")
    assert "the host's 0.30 GB is less than the output layer" in lines[1], lines
