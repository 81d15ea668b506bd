"""The nodes of a machine, on real nodes — `mesh-llm ps` lists each running node (state dir, pid,
model, API URL, state) and forgets one killed with -9; `mesh-llm logs [-f]` prints what the node printed (no colour
codes, never the invite token); `mesh-llm stop` ends the node holding a state dir's lock, by its pid, and says so."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .meshlab import NodeProc, wait_for


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshllm.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})  # fmt: skip


def test_ps_logs_and_stop_on_real_nodes(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(run)}  # this test's nodes only
    nodes: list[NodeProc] = []
    try:
        cfg = tmp_path / "config.toml"  # the config file on a real node: its name and model table, a flag over it
        cfg.write_text(f'name = "from-config"\nmax-vram = 0.3\n[models."{tiny_model}"]\nctx-size = 1024\n')
        a = NodeProc(tmp_path, "a", tiny_model, "--config", str(cfg), "--max-vram", "0.9", env=env)
        b = NodeProc(tmp_path, "b", None, "--join", "mesh1.AAAA", env=env)  # a bad token: it never runs
        nodes += [a, b]
        # the agent lines follow the "ready:" line (a CI run read the log between the two)
        wait_for(lambda: "ready:" in a.text() and "goose: run:" in a.text(), 120, "a to serve")
        assert "capacity 0.9 GB" in a.text() and "\"contextWindow\": 1024" in a.text(), a.text()[-1500:]
        assert [p["name"] for p in a.status()["peers"]] == ["from-config"]  # type: ignore[index]
        assert b.proc.wait(30) == 2
        listed = json.loads(_cli(env, "ps", "--json").stdout)
        assert [(n["state_dir"], n["pid"], n["model"]) for n in listed] == [(str(a.state), a.proc.pid,
                                                                             str(tiny_model))]  # fmt: skip
        assert listed[0]["api"] == f"http://127.0.0.1:{a.port}/v1"
        wait_for(lambda: "host, serving" in _cli(env, "ps").stdout, 30, "ps to say a serves")
        # logs: the node's lines, plain text, no token
        got = _cli(env, "logs", "--state-dir", str(a.state), "-n", "100")
        assert got.returncode == 0 and "ready: http://" in got.stdout and "\x1b[" not in got.stdout, got
        log = (a.state / "node.log").read_text()
        assert (a.state / "token").read_text().strip() not in log and "new mesh" in log
        assert (a.state / "node.log").stat().st_mode & 0o777 == 0o600
        follow = subprocess.Popen([sys.executable, "-m", "meshllm.cli", "logs", "-f", "-n", "0", "--state-dir",
                                   str(a.state)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, **env})  # fmt: skip
        # a second node, killed with -9: listed while it runs, forgotten after
        c = NodeProc(tmp_path, "c", tiny_model, "--ctx-size", "1024", "--join", (a.state / "token").read_text(),
                     env=env)  # fmt: skip
        nodes.append(c)
        wait_for(lambda: len(json.loads(_cli(env, "ps", "--json").stdout)) == 2, 60, "ps to list c")
        # doctor: one line per check; the running node's port is its own, its member reached directly
        def doctor() -> subprocess.CompletedProcess[str]:
            return _cli(env, "doctor", "--state-dir", str(a.state), "--port", str(a.port))

        wait_for(lambda: "members reached: 1 of 1 directly" in doctor().stdout, 30, "doctor to see c")
        doc = doctor()
        assert doc.returncode == 0 and f"the node on {a.state} listens there" in doc.stdout, doc.stdout
        assert all(ln.split()[0] in ("ok", "warn") for ln in doc.stdout.splitlines()), doc.stdout
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = _cli(env, "doctor", "--state-dir", str(tmp_path / "fresh"), "--port", str(taken.getsockname()[1]))
        assert busy.returncode == 1 and "FAIL  API port" in busy.stdout and "--port N" in busy.stdout, busy.stdout
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait(10)
        assert [n["pid"] for n in json.loads(_cli(env, "ps", "--json").stdout)] == [a.proc.pid]
        assert len(list((run / "mesh-llm" / "nodes").glob("*.json"))) == 1  # c's entry went with it
        # stop: a leaves (SIGTERM), its logs -f ends with it
        t0 = time.monotonic()
        stopped = _cli(env, "stop", "--state-dir", str(a.state))
        assert stopped.returncode == 0 and f"pid {a.proc.pid}" in stopped.stdout, stopped
        assert a.proc.poll() is not None and time.monotonic() - t0 < 30
        out, _ = follow.communicate(timeout=15)
        assert "leaving the mesh" in out, out
        again = _cli(env, "stop", "--state-dir", str(a.state))
        assert again.returncode == 2 and "no mesh-llm node runs on state dir" in again.stderr, again
        assert "no mesh-llm node runs on this machine" in _cli(env, "ps").stdout
        missing = _cli(env, "logs", "--state-dir", str(tmp_path / "nowhere"))
        assert missing.returncode == 2 and "no log in" in missing.stderr and len(missing.stderr.splitlines()) == 1
    finally:
        for n in nodes:
            n.stop()
