"""/metrics text: each family once, exact counters (serve/http/metrics.py)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from meshllm.serve.http.metrics import Exposition


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


def test_load_progress_is_read_from_the_current_run_of_the_log(tmp_path: Path) -> None:
    """Load progress: llama-server (patch 0007) prints a line per step; only the current run counts."""
    from meshllm.llama.supervisor import load_progress

    log = tmp_path / "llama-server.log"
    assert load_progress(log) == -1  # no log yet
    log.write_text("\n$ llama-server --model a\nload progress: text_model 100.0%\n\n$ llama-server --model b\n")
    assert load_progress(log) == 0  # a new run: nothing loaded yet
    with log.open("a") as f:
        f.write("load progress: text_model 0.0%\nsome other line\nload progress: text_model 42.7%\n")
    assert load_progress(log) == 42


def test_histograms_are_cumulative_and_give_quantiles() -> None:
    from meshllm.serve.http.metrics import Exposition, Histogram

    h = Histogram()
    for v in (0.03, 0.2, 0.2, 3.0):
        h.observe(v)
    assert h.quantile(0.5) == 0.25 and h.quantile(1.0) == 5.0 and h.last == 3.0
    x = Exposition()
    x.histogram("t_seconds", "test", h)
    text = x.text()
    assert 't_seconds_bucket{le="0.05"} 1' in text and 't_seconds_bucket{le="0.25"} 3' in text
    assert 't_seconds_bucket{le="+Inf"} 4' in text and "t_seconds_count 4" in text
    assert "# TYPE t_seconds histogram" in text
