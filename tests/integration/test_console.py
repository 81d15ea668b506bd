"""The web console in headless Chromium (Debian's chromium + chromedriver, driven by Selenium), and
/metrics parsed by prometheus_client."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

from meshllm.llama.processes import free_port

from .meshlab import NodeProc, wait_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def test_console_shows_the_mesh_and_chats(tmp_path: Path, tiny_model: Path, browser: object) -> None:
    from selenium.webdriver.common.by import By

    drv = browser
    cport = free_port()
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--console", str(cport))
    nodes = [a]
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        token = (a.state / "token").read_text().strip()
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join", token, "--name", "worker-b")
        nodes.append(b)
        b_short = None
        wait_for(lambda: len(a.status().get("peers", [])) == 2, 30, "two nodes")  # type: ignore[arg-type]
        b_short = b_short or next(p["short"] for p in a.status()["peers"] if p["path"] != "self")  # type: ignore[attr-defined, index]
        drv.get(f"http://127.0.0.1:{cport}/")  # type: ignore[attr-defined]

        def segs() -> dict[str, str]:
            # read in one script: the bar is re-rendered on every status change, so element handles go stale
            rows = drv.execute_script(  # type: ignore[attr-defined]
                "return Array.from(document.querySelectorAll('.seg')).map(e => [e.dataset.node, e.innerText])"
            )
            return {k: v for k, v in rows}

        wait_for(lambda: len(segs()) == 2, 20, "both nodes on the page")
        a_short = next(k for k in segs() if k != b_short)
        assert "layers 0–17 + output" in segs()[a_short] and "host" in segs()[a_short]  # the output too
        used = next(p["planned_bytes"] for p in a.status()["peers"] if p["short"] == a_short)  # type: ignore[attr-defined, index]
        assert f"{used / 1e9:.1f} GB of " in segs()[a_short], segs()  # memory planned of offered
        # b holds the whole model too: a replica beside the host, its own layers, listed with the model
        wait_for(lambda: "replica" in segs()[b_short], 30, "b as a replica")
        assert "layers 0–17" in segs()[b_short], segs()
        wait_for(lambda: f"replicas {b_short}" in drv.find_element(By.ID, "m-models").text, 10, "the model's replicas")  # type: ignore[attr-defined]
        assert "gemma" in drv.find_element(By.ID, "m-name").text  # type: ignore[attr-defined]
        assert "pi --provider mesh" in drv.find_element(By.ID, "agents").text  # type: ignore[attr-defined]
        # what a copy button copies is the command alone (it used to copy "goose: ..." with the label)
        copies = drv.execute_script(  # type: ignore[attr-defined]
            "return Array.from(document.querySelectorAll('#agents pre')).map(e => e.textContent)"
        )
        assert copies[0].startswith('{"providers"') and copies[1].startswith("pi --provider mesh"), copies
        assert copies[2].startswith("GOOSE_PROVIDER=openai ") and copies[2].endswith("goose session"), copies
        drv.find_element(By.ID, "show-token").click()  # type: ignore[attr-defined]
        wait_for(lambda: drv.find_element(By.ID, "token").text.startswith("mesh1."), 10, "the token")  # type: ignore[attr-defined]
        # chat: the reply streams in; every turn goes back with the conversation (what the page sends is recorded)
        drv.execute_script(  # type: ignore[attr-defined]
            "window.__sent = []; const f = window.fetch;"
            "window.fetch = (u, o) => { if (u === '/chat') window.__sent.push(JSON.parse(o.body)); return f(u, o); };"
        )

        def ask(text: str) -> object:
            drv.find_element(By.ID, "chat-input").send_keys(text)  # type: ignore[attr-defined]
            drv.find_element(By.ID, "chat-send").click()  # type: ignore[attr-defined]
            last = lambda: drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]  # type: ignore[attr-defined]  # noqa: E731
            wait_for(lambda: len(last().text) > 0, 60, "the first tokens")
            return last()

        first = ask("Name three colors.")
        wait_for(lambda: first.get_attribute("data-done") == "1", 120, "the whole reply")  # type: ignore[attr-defined]
        assert "tok/s" in drv.find_element(By.ID, "chat-stats").text  # type: ignore[attr-defined]
        assert "first token after" in drv.find_element(By.ID, "chat-stats").text  # type: ignore[attr-defined]
        second = ask("And three more.")
        wait_for(lambda: second.get_attribute("data-done") == "1", 120, "the second reply")  # type: ignore[attr-defined]
        sent = drv.execute_script("return window.__sent")  # type: ignore[attr-defined]
        assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"], sent
        assert sent[1]["messages"][1]["content"].strip() == first.text.strip() and sent[1]["temperature"] == 0.7  # type: ignore[attr-defined]
        # a long reply can be stopped; the box is usable again at once
        # a new chat (the node's context is 1024 tokens); greedy, this prompt runs the tiny model to any limit
        drv.find_element(By.ID, "chat-clear").click()  # type: ignore[attr-defined]
        assert not drv.find_elements(By.CSS_SELECTOR, ".msg")  # type: ignore[attr-defined]
        drv.execute_script(  # type: ignore[attr-defined]
            "document.getElementById('chat-max').value = 900; document.getElementById('chat-temp').value = 0"
        )
        long = ask("Count from 1 to 1000, one number per line.")
        assert drv.find_element(By.ID, "chat-input").get_attribute("disabled") is not None  # type: ignore[attr-defined]
        drv.find_element(By.ID, "chat-stop").click()  # type: ignore[attr-defined]
        wait_for(lambda: long.get_attribute("data-done") == "1", 30, "the stop to take")  # type: ignore[attr-defined]
        assert long.get_attribute("data-stopped") == "1" and long.text.endswith("[stopped]")  # type: ignore[attr-defined]
        assert drv.find_element(By.ID, "chat-input").get_attribute("disabled") is None  # type: ignore[attr-defined]
        sent = drv.execute_script("return window.__sent")  # type: ignore[attr-defined]
        assert [m["role"] for m in sent[2]["messages"]] == ["user"], sent[2]  # the new chat starts afresh
        ARTIFACTS.mkdir(exist_ok=True)
        drv.execute_script("window.scrollTo(0, 0)")  # type: ignore[attr-defined]
        # the chat sat below the fold: at 1200x900, its input is in the first screen, conversation and all
        js = "const r = document.getElementById('chat-input').getBoundingClientRect(); return [r.bottom, innerHeight]"
        bottom, height = drv.execute_script(js)  # type: ignore[attr-defined]
        assert 0 < bottom <= height, (bottom, height)
        drv.save_screenshot(str(ARTIFACTS / "console.png"))  # type: ignore[attr-defined]
        drv.save_screenshot(str(tmp_path / "console-desktop.png"))  # type: ignore[attr-defined]
        # a phone (390x844): one column, nothing wider than the screen, the chat's input on it
        drv.set_window_size(390, 844)  # type: ignore[attr-defined]
        time.sleep(0.5)
        js = ("const i = document.getElementById('chat-input'), r = i.getBoundingClientRect(),"
              " c = i.closest('.card').getBoundingClientRect();"
              "return [document.documentElement.scrollWidth, innerWidth, r.left, r.right,"
              " c.right - c.left]")  # fmt: skip
        wide, inner, left, right, card = drv.execute_script(js)  # type: ignore[attr-defined]
        assert inner <= 420 and wide <= inner and 0 <= left < right <= inner, (wide, inner, left, right)
        assert card > inner * 0.8, (card, inner)  # one column: the chat's card spans the screen, not half of it
        drv.save_screenshot(str(tmp_path / "console-phone.png"))  # type: ignore[attr-defined]
        drv.set_window_size(1200, 900)  # type: ignore[attr-defined]
        # nodes by name (the hostname by default); requests in words, not JSON
        assert segs()[b_short].startswith("worker-b · ") and segs()[a_short].startswith(socket.gethostname()[:32])
        assert "× 200" in drv.find_element(By.ID, "m-req").text  # type: ignore[attr-defined]
        # the whole mesh's counts (the host's llama-server: every completion runs there) and first-token times
        wait_for(lambda: re.search(r"[1-9]\d* tokens generated", drv.find_element(By.ID, "m-tps").text) is not None,  # type: ignore[attr-defined]
                 10, "the mesh's token count")  # fmt: skip
        assert "ms median" in drv.find_element(By.ID, "m-ttft").text  # type: ignore[attr-defined]
        wait_for(lambda: "ms average over" in drv.find_element(By.ID, "m-ttft").text, 10, "the mesh's first-token time")  # type: ignore[attr-defined]
        assert re.fullmatch(r"\d+ of \d+ busy, \d+ waiting · \d+ tokens each",  # the host's slots
                            drv.find_element(By.ID, "m-slots").text), drv.find_element(By.ID, "m-slots").text  # type: ignore[attr-defined]

        def timeline() -> str:
            return str(drv.find_element(By.ID, "timeline").text)  # type: ignore[attr-defined]

        assert "ready:" in timeline() and f"peer {b_short} joined" in timeline(), timeline()
        # a node killed -9 is shown as not heard from once it is suspect, then disappears, and the timeline says so
        b.stop(signal.SIGKILL)
        wait_for(lambda: "not heard from" in segs().get(b_short, ""), 20, "b to be shown as suspect")
        wait_for(lambda: list(segs()) == [a_short], 30, "b to vanish from the page")
        dead = f"peer {b_short} went silent and is declared dead"
        wait_for(lambda: dead in timeline(), 10, "the death in the timeline")
        assert timeline().index("declared dead") < timeline().index("joined")  # newest first
        # the page's own node dies: the page greys out and says since when it is stale
        a.stop(signal.SIGKILL)
        wait_for(lambda: "lost" in (drv.find_element(By.TAG_NAME, "body").get_attribute("class") or ""), 15,  # type: ignore[attr-defined]
                 "the page to grey out")  # fmt: skip
        assert drv.find_element(By.ID, "conn").text.startswith("lost contact at "), drv.find_element(By.ID, "conn").text  # type: ignore[attr-defined]
        drv.save_screenshot(str(tmp_path / "console-lost.png"))  # type: ignore[attr-defined]
    finally:
        for n in nodes:
            n.stop()


def test_metrics_parse_and_move(tmp_path: Path, tiny_model: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024")
    nodes = [a]
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        c = NodeProc(tmp_path, "c", None, "--join", (a.state / "token").read_text().strip())  # a lite client
        nodes.append(c)
        wait_for(lambda: "API up:" in c.text(), 60, "c's API")
        # load progress: llama-server (patch 0007) reports each step; the host reads the last one
        assert "load progress: text_model 100.0%" in a.text_of("llama-server.log")

        def scrape(n: NodeProc = a) -> dict[str, float]:
            with urllib.request.urlopen(f"http://127.0.0.1:{n.port}/metrics", timeout=10) as r:
                text = r.read().decode()
                assert "version=0.0.4" in r.headers["Content-Type"], r.headers["Content-Type"]
            assert "e+" not in text  # counters exact, not %g
            families = list(text_string_to_metric_families(text))
            names = [f.name for f in families]
            assert len(names) == len(set(names)), names  # each family once (samples not interleaved)
            assert not [n for n in names if n.endswith(("_ms", "_milliseconds"))], names  # base units
            out: dict[str, float] = {}
            for fam in families:
                for s in fam.samples:
                    key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                    out[key] = s.value
            return out

        before = scrape()
        body = json.dumps({"prompt": "Hello", "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{a.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(req, timeout=60).read()
        wait_for(lambda: scrape()['mesh_llm_requests_total{"status": "200"}'] > before.get(
            'mesh_llm_requests_total{"status": "200"}', 0), 10, "the request to be counted")  # fmt: skip
        after = scrape()
        assert after["mesh_llm_tokens_generated_total"] >= before.get("mesh_llm_tokens_generated_total", 0) + 12
        assert after['mesh_llm_requests_total{"status": "200"}'] > before.get(
            'mesh_llm_requests_total{"status": "200"}', 0
        )
        assert after["mesh_llm_tokens_per_second"] > 0
        urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=10).read()
        ok = 'mesh_llm_requests_total{"status": "200"}'
        assert scrape()[ok] == after[ok]  # probes (/metrics, /health) are not requests to the model
        assert after["mesh_llm_decode_seconds_total"] > before.get("mesh_llm_decode_seconds_total", 0)
        assert any(k.startswith("mesh_llm_build_info") for k in after)
        # counts were per node only: a request through the lite client is counted mesh-wide by the host's
        # llama-server, and every node shows that count (from the host's gossip); latency and time to first token
        # are histograms
        mesh = "mesh_llm_mesh_tokens_generated_total"
        wait_for(lambda: scrape().get(mesh, 0) >= 12 and scrape(c).get(mesh, 0) >= 12, 15, "the mesh-wide count")
        had = scrape(c)[mesh]
        req = urllib.request.Request(f"http://127.0.0.1:{c.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(req, timeout=60).read()
        wait_for(lambda: scrape(c)[mesh] >= had + 12 and scrape()[mesh] >= had + 12, 15, "c's request counted")
        on_c = scrape(c)
        assert on_c["mesh_llm_request_seconds_count"] == 1 and on_c["mesh_llm_time_to_first_token_seconds_count"] == 1
        assert on_c['mesh_llm_request_seconds_bucket{"le": "+Inf"}'] == 1
        assert 0 < on_c["mesh_llm_time_to_first_token_seconds_sum"] <= on_c["mesh_llm_request_seconds_sum"]
        assert scrape()["mesh_llm_request_seconds_count"] == 1  # a's own: the first request only
        # the mesh's time to first token: each node's own count and sum, gossiped; a and c agree
        wait_for(lambda: all((n.status().get("mesh_ttft_s") or {}).get("count") == 2 for n in (a, c)), 15,
                 "both requests' first-token times on both nodes")  # fmt: skip
        # serving state, requests in flight, the host's slots, peers by name as well as id
        on_c = scrape(c)
        assert on_c["mesh_llm_serving"] == 1 and on_c["mesh_llm_requests_in_flight"] == 0
        assert on_c["mesh_llm_slots_total"] >= 1 and on_c["mesh_llm_queue_depth"] == 0
        assert any(k.startswith("mesh_llm_peer_direct") and f'"name": "{socket.gethostname()[:32]}"' in k
                   and f'"peer": "{a.short()}"' in k for k in on_c), on_c  # fmt: skip
        slow = json.dumps({"prompt": "Once", "max_tokens": 3000, "ignore_eos": True, "stream": True}).encode()
        streaming = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{c.port}/v1/completions", data=slow, headers={"Content-Type": "application/json"}),
            timeout=60)  # fmt: skip
        try:
            streaming.readline()
            assert scrape(c)["mesh_llm_requests_in_flight"] == 1  # c's API passes it on: c counts it
            wait_for(lambda: scrape(c)["mesh_llm_slots_busy"] == 1, 5, "the host's slot, as c sees it")
        finally:
            streaming.close()
    finally:
        for n in nodes:
            n.stop()
