"""Slow clients exhaust the API before the key is checked, performed against a real node with
--listen-all under a 1,024-file limit (as the audit found it). 1,100 connections from one address each send half a
request head and stop. Before: they took every file descriptor, a client with the key was kept out for 80 s and the
node grew 208 MB. Now one address holds at most 64 connections, a head must arrive within 10 s (the connection is
closed otherwise), the node raises its own file limit, and the client with the key is answered at once."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import time
import urllib.request
from pathlib import Path

import psutil

from meshllm.serve.http.gate import HEADERS_S, PER_ADDRESS
from tests.integration.meshlab import NodeProc, wait_for

KEY = "slowloris-test-key-0123456789"


def _ask(port: int) -> float:
    """A completion with the key, from 127.0.0.1: how long it took."""
    t0 = time.monotonic()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps({"prompt": "Hi", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    return time.monotonic() - t0


def test_half_sent_requests_from_one_address_keep_nobody_out(tmp_path: Path, tiny_model: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))  # ours: the attacker's sockets
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--listen-all",
                 env={"MESH_LLM_API_KEY": KEY}, wrap=("prlimit", "--nofile=1024:8192", "--"))  # fmt: skip
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        calm = _ask(a.port)
        rss0 = _rss(a)
        socks += _half_sent("127.0.0.2", a.port, 1100)
        time.sleep(1)
        took = _ask(a.port)
        print(f"\na client with the key, 1,100 half-sent requests open: {took:.2f} s (calm {calm:.2f} s); "
              f"node RSS +{(_rss(a) - rss0) / 1e6:.1f} MB")
        assert took < 10, f"the client with the key waited {took:.1f} s"
        held = [s for s in socks if _open(s)]
        assert len(held) <= PER_ADDRESS, f"{len(held)} connections from one address held open"
        time.sleep(HEADERS_S + 2)
        assert not [s for s in socks if _open(s)], "a head that never came still holds its connection"
        assert _rss(a) - rss0 < 50e6
    finally:
        for s in socks:
            s.close()
        a.stop()


def _half_sent(src: str, port: int, n: int) -> list[socket.socket]:
    """``n`` connections from ``src`` to the API, each with half a request head sent (those the node accepted)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind((src, 0))
        s.settimeout(5)
        try:
            s.connect((src, port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


def _rss(n: NodeProc) -> int:
    return int(psutil.Process(n.proc.pid).memory_info().rss) if n.proc.poll() is None else 0


def _open(s: socket.socket) -> bool:
    """Whether the server still holds this connection (no EOF or reset yet)."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            s.setblocking(True)


def test_many_addresses_of_one_client_keep_no_client_with_the_key_out(tmp_path: Path, tiny_model: Path) -> None:
    """A stranger with 13 addresses held 64 half-sent requests on each, 832 > the gate's 768, and a client
    with the key got 0 of 29 requests through in 60 s. Here the 13 addresses are 127.0.0.2-14 (one local user: one
    client, as the /64 of one IPv6 host would be — ``gate.client_of``, unit-tested); the node is at 1,024 files as
    before. Now they share one client's 64, and a newcomer closes the oldest connection that never presented the key:
    the client with the key is served every time, and the stranger holds no more than its share."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--listen-all",
                 env={"MESH_LLM_API_KEY": KEY}, wrap=("prlimit", "--nofile=1024:8192", "--"))  # fmt: skip
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        for i in range(13):
            socks += _half_sent(f"127.0.0.{2 + i}", a.port, 64)
        time.sleep(1)
        took = [_ask(a.port) for _ in range(29)]
        held = [s for s in socks if _open(s)]
        print(f"\n832 half-sent requests from 13 addresses: the client with the key served 29 of 29, slowest "
              f"{max(took):.2f} s; {len(held)} of the stranger's connections still held")
        assert max(took) < 10
        assert len(held) <= PER_ADDRESS, f"{len(held)} connections of one client held open"
    finally:
        for s in socks:
            s.close()
        a.stop()
