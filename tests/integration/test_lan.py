"""A mesh found on the LAN, joined only with approval — real nodes, real mDNS (zeroconf on this machine's
network), real knocks over QUIC, the real `mesh-llm approve`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from meshllm.proto import crypto
from meshllm.serve.life.lan import browse

from .meshlab import NodeProc, _free_port, wait_for
from .test_fleet import _complete, _founder


def _approve(a: NodeProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshllm.cli", "approve", *args, "--state-dir", str(a.state)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip


def _console(port: int, path: str, body: dict[str, str] | None = None, ctype: str = "application/json"
             ) -> dict[str, object] | int:  # fmt: skip
    """The console's answer (JSON), or its status when it is not 200."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as e:
        return json.loads(e.read()) if e.code == 400 else e.code  # type: ignore[no-any-return]


def _announcers(mesh: str) -> set[str]:
    return {crypto.short(m.node) for m in asyncio.run(browse(2.0)) if m.mesh_id.hex().startswith(mesh)}


def _announced(mesh: str) -> bool:
    return any(m.mesh_id.hex().startswith(mesh) for m in asyncio.run(browse(2.0)))


def test_a_node_on_the_lan_asks_to_join_and_only_the_approved_one_gets_in(tmp_path: Path, tiny_model: Path) -> None:
    name = tiny_model.stem
    nodes: list[NodeProc] = []
    try:
        console = _free_port()
        a, _ = _founder(tmp_path, tiny_model, nodes, "--console", str(console))
        mesh = re.search(r"new mesh (\w{8})", a.text()).group(1)  # type: ignore[union-attr]
        wait_for(lambda: _announced(mesh), 30, "a's announcement on the LAN")
        wait_for(lambda: _complete(a.port, name)[0] == 200, 60, "a to serve")
        # b asks to join; so does s, a stranger nobody approves
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join-lan", mesh, "--name", "laptop-b")
        s = NodeProc(tmp_path, "s", None, "--client", "--join-lan", mesh, "--name", "stranger")
        nodes += [b, s]
        for n in (b, s):
            wait_for(lambda n=n: f"asked to join mesh {mesh}" in n.text(), 60, f"{n.state.name}'s knock")  # type: ignore[misc]
        wait_for(lambda: "laptop-b" in _approve(a).stdout and "stranger" in _approve(a).stdout, 10, "both listed")
        assert "asks to join this mesh" in a.text()
        assert "joined mesh" not in b.text() and not b.peers() - {b.short()}, b.text()  # nothing admitted yet
        assert a.peers() == {a.short()}, a.peers()
        bad = _approve(a, "zzzz")
        assert bad.returncode != 0 and "names no single node" in bad.stderr, bad.stderr
        # the console lists them too, and approves with a button: JSON only (a cross-site form cannot post it)
        shown = {k["name"]: k["node"] for k in _console(console, "/knocks")["knocks"]}  # type: ignore[attr-defined]
        assert set(shown) == {"laptop-b", "stranger"}, shown
        assert _console(console, "/approve", {"node": shown["laptop-b"]}, "text/plain") == 415
        assert "names no single node" in str(_console(console, "/approve", {"node": "zzzz"}))
        t0 = time.monotonic()
        ok = _console(console, "/approve", {"node": shown["laptop-b"], "scope": "worker"})
        assert "approved" in str(ok.get("said")), ok  # type: ignore[union-attr]
        wait_for(lambda: "joined mesh" in b.text() and _complete(b.port, name)[0] == 200, 30, "b to join and answer")
        took = time.monotonic() - t0
        assert "scope worker" in b.text(), b.text()[-2000:]  # the scope approved, in its admission chain
        print(f"\napproved -> b joined and answered through the mesh: {took:.1f} s")
        # only the founder (or an admin) announces the mesh and answers knocks: b, a worker now, does not
        assert {crypto.short(m.node) for m in asyncio.run(browse(2.0)) if m.mesh_id.hex().startswith(mesh)} == {
            a.short()}  # fmt: skip
        # the stranger saw the announcement and knocked; it is in nothing and sees nothing
        time.sleep(2 * 2)  # two more of its knocks
        assert "joined mesh" not in s.text() and not s.peers() - {s.short()}, s.text()[-1000:]
        assert s.short() not in a.peers() and s.short() not in b.peers()
        assert _complete(s.port, name)[0] == 503
        assert "stranger" in _approve(a).stdout  # still waiting
        # turned away (the console's other button): its next knock says so, and it stops with one line
        assert "refused" in str(_console(console, "/refuse", {"node": shown["stranger"]}).get("said"))  # type: ignore[union-attr]
        wait_for(lambda: s.proc.poll() is not None, 10, "the stranger to stop")
        assert s.proc.returncode != 0 and "the founder or an admin refused this node" in s.text(), s.text()[-500:]
        assert "stranger" not in _approve(a).stdout
        # b made an admin while both run: it announces the mesh too (it checks every 2 s), no restart
        made = subprocess.run([sys.executable, "-m", "meshllm.cli", "admin", b.short(), "--state-dir", str(a.state)],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert made.returncode == 0, made.stderr
        wait_for(lambda: b.short() in _announcers(mesh), 30, "b's announcement as an admin")
    finally:
        for n in nodes:
            n.stop()


def test_no_announce_keeps_the_mesh_off_the_lan(tmp_path: Path, tiny_model: Path) -> None:
    nodes: list[NodeProc] = []
    try:
        a, _ = _founder(tmp_path, tiny_model, nodes, "--no-announce")
        mesh = re.search(r"new mesh (\w{8})", a.text()).group(1)  # type: ignore[union-attr]
        wait_for(lambda: "listening on UDP" in a.text(), 30, "a to start")
        time.sleep(1)
        assert not _announced(mesh)
        out = _approve(a)
        assert out.returncode == 0 and "no node waits for approval" in out.stdout, out.stdout + out.stderr
    finally:
        for n in nodes:
            n.stop()
