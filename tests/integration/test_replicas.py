"""Replicas. a founds the mesh with the tiny model, b joins with a whole copy of it, c is a lite client.
The elected host (the same capacity: the higher id, unless a was elected before b joined — a sitting host keeps the
role, so which one it is depends on b's start) needs itself alone, so the other serves a replica beside it:
every node lists both hosts of the model, requests go to both, and a streamed answer whose host is killed -9 mid-way
goes on at the other — one stream, no error, the text of the uninterrupted answer — with no model load on the way
(the survivor already serves)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .meshlab import NodeProc, children, wait_for
from .test_fleet import _complete, _founder, _get, _kill_mid_stream, _slots_busy, _stream, _text

DONE = "prompt eval time"  # llama-server's timing line: one per request it ran


def _models(port: int) -> dict[str, dict[str, object]]:
    try:
        return {m["id"]: m.get("meshllm", {}) for m in _get(port, "/v1/models")["data"]}  # type: ignore[attr-defined]
    except OSError:
        return {}


def _settled(servers: tuple[NodeProc, ...], quiet_s: float = 2.0) -> list[int]:
    """Each server's count of timing lines once none has come for ``quiet_s`` (bounded): the line of a request just
    answered may come a moment after its answer, and counted later it would look like one of the next requests."""
    counts, since, t0 = None, time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < 30:
        now = [n.text_of("llama-server.log").count(DONE) for n in servers]
        if now != counts:
            counts, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.1)
    raise AssertionError(f"llama-servers' timing lines still coming after 30 s: {counts}")


def _timing_lines_after(request: Callable[[], object], servers: tuple[NodeProc, ...]) -> list[int]:
    """Each server's count of timing lines once ``request`` (one request) has run and its line is written: read
    straight after the answer, the count could miss it, and a later "one more line" would then be this one."""
    before = [n.text_of("llama-server.log").count(DONE) for n in servers]
    request()
    now = lambda: [n.text_of("llama-server.log").count(DONE) for n in servers]  # noqa: E731
    wait_for(lambda: sum(now()) == sum(before) + 1, 10, "the request's timing line")
    return now()


def test_a_whole_copy_beside_the_host_serves_a_replica(tmp_path: Path, tiny_model: Path) -> None:
    name = tiny_model.stem
    nodes: list[NodeProc] = []
    try:
        a, token = _founder(tmp_path, tiny_model, nodes)
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join", token)
        c = NodeProc(tmp_path, "c", None, "--client", "--join", token)
        nodes += [b, c]
        # every node, the lite client too, lists the model with its host and its replica
        wait_for(lambda: (b.state / "key").exists(), 30, "b's key")
        pair = {a.short(), b.short()}

        def listed() -> bool:  # both listed on every node, one as the host, the other as its replica
            for n in (a, b, c):
                m = _models(n.port).get(name, {})
                reps = m.get("replicas")
                if m.get("state") != "serving" or not isinstance(reps, list) or len(reps) != 1:
                    return False
                if {m.get("host"), reps[0]} != pair:
                    return False
            return True

        wait_for(listed, 120, "a replica listed everywhere")
        host, rep = (a, b) if _models(c.port)[name]["host"] == a.short() else (b, a)
        for n in (a, b, c):
            m = _models(n.port)[name]
            assert m["host"] == host.short() and m["nodes"] == [host.short(), rep.short()], m
        # it says so at once in gossip; its plan is adopted once it has held 2 s, then its llama-server starts
        wait_for(lambda: "ready:" in rep.text(), 60, "the replica's llama-server")
        assert "replica: this node serves the whole model" in rep.text(), rep.text()[-2000:]
        out = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--state-dir", str(c.state)],
                             capture_output=True, text=True, timeout=30, env={"COLUMNS": "120"})  # fmt: skip
        assert f"replicas {rep.short()}" in out.stdout, out.stdout + out.stderr

        # requests through the lite client go to both (by load: 8 at once never all to one)
        wait_for(lambda: _complete(c.port, name)[0] == 200, 30, "c to answer")
        wait_for(lambda: f"served by replica {rep.short()}" in c.text(), 30, "c's tunnel to the replica")
        before = _settled((a, b))  # the probe's line above may still be on its way
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: _complete(c.port, name)[0], range(8)))
        assert codes == [200] * 8

        def ran() -> list[int]:  # llama-server logs a request's timing a moment after its answer ends
            return [n.text_of("llama-server.log").count(DONE) - k for n, k in zip((a, b), before, strict=True)]

        wait_for(lambda: sum(ran()) == 8, 10, "llama-servers' timing lines of the 8 requests")
        assert min(ran()) >= 2, ran()
        print(f"\n8 requests at once through a lite client: {ran()[0]} ran on the host, {ran()[1]} on the replica")

        # a host killed -9 mid-stream: the answer goes on at the other one, which loads nothing
        body = {"model": name, "prompt": "Count from 1 to 100, separated by commas: 1, 2,", "max_tokens": 300,
                "temperature": 0, "stream": True}  # fmt: skip
        ref: list[bytes] = []
        counts = _timing_lines_after(lambda: _stream(c.port, body, ref), (a, b))
        assert ref[-1] == b"data: [DONE]" and len(_text(ref)) > 100, ref[-3:]
        # the one running it (its own record says a slot is busy) killed -9 after 20 events
        victim, stall = _kill_mid_stream(c.port, body, [a, b], nodes, ref)
        other = b if victim is a else a
        # llama-server writes a request's timing line a moment after the answer's last byte: waited for, bounded
        wait_for(lambda: other.text_of("llama-server.log").count(DONE) > counts[(a, b).index(other)], 10,
                 "the survivor's timing line of the continued answer")  # fmt: skip
        assert "continuing on" in c.text(), c.text()[-2000:]
        role = "the elected host" if victim is host else "the replica"
        print(f"{role} killed -9 mid-stream: the client's longest wait between events {stall:.1f} s; "
              "the uninterrupted text")  # fmt: skip
        # the survivor is the model's only host now, and its llama-server was never restarted
        wait_for(lambda: _models(c.port).get(name, {}).get("host") == other.short(), 30, "the survivor as the host")
        assert _models(c.port)[name]["replicas"] == []
        assert other.text().count("ready:") == 1 and "llama-server exited" not in other.text(), other.text()[-2000:]
        assert _complete(c.port, name)[0] == 200
    finally:
        for n in nodes:
            n.stop()


def test_nodes_that_hold_the_model_only_together_serve_a_replica_that_is_a_split(tmp_path: Path,
                                                                                 tiny_model: Path) -> None:  # fmt: skip
    """"As two splits": four nodes with whole copies, each with memory for half of the model (any two hold
    it, none alone). The elected host's plan takes one worker; the two it leaves out serve a second split, hosted
    by the one with the most memory (``fleet.split_replica_host``) over the other's rpc-server; every node lists it
    as a replica and requests through a lite client run on both splits."""
    name = tiny_model.stem
    half = ("--max-vram", "0.446", "--ctx-size", "1024")
    nodes: list[NodeProc] = []
    try:
        _, token = _founder(tmp_path, tiny_model, nodes, "--max-vram", "0.446")
        for n in "bcd":
            nodes.append(NodeProc(tmp_path, n, tiny_model, *half, "--join", token))
        e = NodeProc(tmp_path, "e", None, "--client", "--join", token)
        nodes.append(e)
        four = nodes[:4]

        def listed() -> bool:
            ms = [_models(n.port).get(name, {}) for n in (*four, e)]
            return all(m.get("state") == "serving" and len(m.get("replicas") or []) == 1 and len(m["nodes"]) == 4
                       for m in ms)  # type: ignore[arg-type]  # fmt: skip

        wait_for(listed, 180, "a replica split listed everywhere")
        m = _models(e.port)[name]
        by_short = {n.short(): n for n in four}
        host, rep = by_short[str(m["host"])], by_short[m["replicas"][0]]  # type: ignore[index]
        wait_for(lambda: "ready:" in rep.text(), 90, "the replica's llama-server")
        st = _get(rep.port, "/mesh/status")
        planned = {x["node"][:8] for x in st["plan"]["assignments"]}  # type: ignore[index]
        h_st = _get(host.port, "/mesh/status")
        h_planned = {x["node"][:8] for x in h_st["plan"]["assignments"]}  # type: ignore[index]
        assert len(planned) == len(h_planned) == 2 and not planned & h_planned, (planned, h_planned)
        assert rep.short() in planned and host.short() in h_planned
        worker = by_short[(planned - {rep.short()}).pop()]
        said = f"with {worker.short()} beside host {host.short()}"
        assert "replica: this node hosts a split of the model (" in rep.text() and said in rep.text(), rep.text()
        assert str(_get(worker.port, "/mesh/status")["host"])[:8] == rep.short()  # it serves its layers for the replica
        states = {p["short"]: p["state"] for p in _get(e.port, "/mesh/status")["peers"]}  # type: ignore[attr-defined]
        assert states[worker.short()] == "serving", states  # not "standby": it serves in the replica's split
        wait_for(lambda: _complete(e.port, name)[0] == 200, 60, "e to answer")
        wait_for(lambda: f"served by replica {rep.short()}" in e.text(), 30, "e's tunnel to the replica")
        before = _settled((host, rep))
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: _complete(e.port, name)[0], range(8)))
        assert codes == [200] * 8

        def ran() -> list[int]:
            return [n.text_of("llama-server.log").count(DONE) - k for n, k in zip((host, rep), before, strict=True)]

        wait_for(lambda: sum(ran()) == 8, 20, "llama-servers' timing lines of the 8 requests")
        assert min(ran()) >= 2, ran()
        print(f"\n8 requests at once through a lite client: {ran()[0]} on the elected host's split, {ran()[1]} on "
              "the replica's")  # fmt: skip

        # the llama-server running a stream killed -9 (its node lives on): the host's door cuts the stream, and the
        # lite client, which sees both splits, continues it on the other one (not the door on its own llama-server
        # once that is back)
        body = {"model": name, "prompt": "Count from 1 to 100, separated by commas: 1, 2,", "max_tokens": 200,
                "temperature": 0, "stream": True}  # fmt: skip
        ref: list[bytes] = []
        counts = _timing_lines_after(lambda: _stream(e.port, body, ref), (host, rep))
        said = len(e.text())
        victim, stall = _kill_mid_stream(e.port, body, [host, rep], nodes, ref, child="llama-server", exact=False)
        other = rep if victim is host else host
        assert "continuing on" in e.text()[said:], e.text()[said:]
        assert "continuing on" not in victim.text(), victim.text()[-2000:]
        wait_for(lambda: other.text_of("llama-server.log").count(DONE) > counts[(host, rep).index(other)], 10,
                 "the continuation's timing line on the other split")  # fmt: skip
        print(f"the {'host' if victim is host else 'replica'}'s llama-server killed -9 mid-stream: the client's "
              f"longest wait between events {stall:.1f} s; one stream, continued on the other split")
    finally:
        for n in nodes:
            n.stop()


def _server_pid(n: NodeProc) -> int:
    return next(p.pid for p in children(n.proc) if "llama-server" in p.name())


def test_a_hosts_death_leaves_the_other_replicas_serving_as_they_were(tmp_path: Path, tiny_model: Path) -> None:
    """Three whole copies (the elected host and two replicas) and a lite client; three streamed answers at once
    (one on each, by load), and the elected host killed -9 mid-way. Roles change, processes don't: both survivors'
    llama-servers keep their pids (no restart), and the answer that moves is cut once — every answer whole."""
    name = tiny_model.stem
    nodes: list[NodeProc] = []
    try:
        a, token = _founder(tmp_path, tiny_model, nodes)
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join", token)
        d = NodeProc(tmp_path, "d", tiny_model, "--ctx-size", "1024", "--join", token)
        c = NodeProc(tmp_path, "c", None, "--client", "--join", token)
        nodes += [b, d, c]
        wait_for(lambda: len(_models(c.port).get(name, {}).get("replicas") or []) == 2, 120, "two replicas listed")
        trio = [a, b, d]
        wait_for(lambda: all(n.text().count("ready:") == 1 for n in trio), 90, "three llama-servers")
        wait_for(lambda: all(f"by replica {r}" in c.text() for r in _models(c.port)[name]["replicas"]),  # type: ignore[union-attr]
                 30, "c's tunnels to both replicas")  # fmt: skip
        pids = {n.short(): _server_pid(n) for n in trio}
        body = {"model": name, "prompt": "Count from 1 to 100, separated by commas: 1, 2,", "max_tokens": 64,
                "temperature": 0, "stream": True}  # fmt: skip
        ref: list[bytes] = []
        _stream(c.port, body, ref)
        host = next(n for n in trio if n.short() == _models(c.port)[name]["host"])
        got: list[list[bytes]] = [[], [], []]
        began = [threading.Event() for _ in got]
        threads = [threading.Thread(target=_stream, args=(c.port, body, got[i],
                                                          lambda k, i=i: k >= 20 and began[i].set()))
                   for i in range(3)]  # fmt: skip
        for th in threads:
            th.start()
        assert all(e.wait(60) for e in began), "the streams did not start"
        busy = lambda: [n.short() for n in trio if _slots_busy(n)]  # noqa: E731
        wait_for(lambda: host.short() in busy(), 10, f"a stream on the host (busy: {busy()})")
        host.stop(signal.SIGKILL)
        nodes.remove(host)
        log = host.text_of("llama-server.log")  # the answers its death cut: started and never released
        cut = log.count("launch_slot_") - log.count("stop processing")
        assert cut >= 1, log[-2000:]
        for th in threads:
            th.join(180)
        for g in got:  # whole (concurrent answers on one server may part from the lone one's text at a near tie)
            assert g[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in g), g[-3:]
            assert _text(g).startswith(_text(ref)[:20]) and len(_text(g)) > 40, _text(g)
        left = [n for n in trio if n is not host]
        wait_for(lambda: _models(c.port).get(name, {}).get("host") in {n.short() for n in left}, 30, "a new host")
        time.sleep(5)  # a replan after the election would restart one within this (PLAN_DEBOUNCE_S is 2 s)
        for n in left:
            assert _server_pid(n) == pids[n.short()] and n.text().count("ready:") == 1, n.text()[-3000:]
        assert c.text().count("continuing on") == cut, c.text()[-3000:]  # each moved answer cut once
        assert _complete(c.port, name)[0] == 200
    finally:
        for n in nodes:
            n.stop()
