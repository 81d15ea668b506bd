"""[face] /metrics text: each family once, exact counters (serve/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from meshllm.serve.metrics import Exposition


def test_families_stay_together_and_counters_stay_exact() -> None:
    x = Exposition()
    for peer in ("aa", "bb"):  # per peer, two families in turn: what interleaved them before
        x.metric("mesh_llm_tunnel_bytes_sent_total", "counter", "sent", 183_804_123, {"peer": peer})
        x.metric("mesh_llm_peer_rtt_seconds", "gauge", "rtt", 0.0021, {"peer": peer})
    text = x.text()
    assert "183804123" in text and "e+" not in text
    fams = list(text_string_to_metric_families(text))
    assert [f.name for f in fams] == ["mesh_llm_tunnel_bytes_sent", "mesh_llm_peer_rtt_seconds"]
    assert [len(f.samples) for f in fams] == [2, 2]
    assert text.count("# TYPE mesh_llm_tunnel_bytes_sent_total counter") == 1
