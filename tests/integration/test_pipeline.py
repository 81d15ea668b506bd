"""Worker to worker (patch 0011): at a boundary between two rpc-servers of a layer split, the hidden state
goes from one straight to the next (PEER_SEND / PEER_RECV over a TLS link whose key llama-server made), not through
llama-server. Real patched and stock binaries, the real model, loopback; openssl's own client as the stranger."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshllm.llama.build import Binaries
from meshllm.llama.processes import Child, free_port, rpc_server_argv, wait_tcp_ready
from meshllm.llama.rpcwire import CONN_CAPS_SIZE, GGUF_CAPS_MAGIC, HEADER, Cmd, CountingRelay, WireStats

from .meshlab import NodeProc, serves, wait_for
from .splitlab import PROMPT, Split, Worker, start_split, stock_split_text, stop_split
from .test_rpc_direct import _rpc_path
from .test_serve_split import N as SPLIT_N
from .test_serve_split import _assignments, complete, text_of

N = 48  # tokens per answer
N_EMBD = 640  # the tiny model's hidden size
MB = 1_000_000
SPLIT = [6.0, 6.0, 7.0]  # layers of rpc0, rpc1 and the last device (the host's own: the output stays there)


@pytest.fixture(scope="module")
def module_children() -> Iterator[list[Child]]:
    children: list[Child] = []
    yield children
    for c in children:
        c.stop()


def _split(tmp: Path, client: Binaries, workers: list[Worker], model: Path, children: list[Child],
           env: dict[str, str] | None = None, ctx: int = 1024) -> Split:  # fmt: skip
    relays: list[CountingRelay] = []
    env = {"LLAMA_INPUT_ON_FIRST_RPC": "0", **(env or {})}  # the token embedding on llama-server's CPU (stock)
    return start_split(tmp, client, workers, model, children, relays, env=env, threads=2, tensor_split=SPLIT,
                       extra=["--fit", "off", "--ctx-size", str(ctx)])  # fmt: skip


def _through_host(s: Split, n: int) -> tuple[str, list[WireStats]]:
    """The answer, and what crossed llama-server's connections to the two workers while it was made."""
    before = [r.snapshot() for r in s.relays[:2]]
    text = s.complete(PROMPT, n)
    return text, [r.snapshot().minus(b) for r, b in zip(s.relays[:2], before, strict=True)]


def _total(w: list[WireStats]) -> int:
    return sum(x.bytes_up + x.bytes_down for x in w)


def _workers(bins: Binaries, model: Path, peers: bool) -> list[Worker]:
    """rpc0 -> rpc1 with peer listeners when ``peers``; the last device never has one (it plays the host's own)."""
    ports = [free_port(), free_port()] if peers else [None, None]
    return [Worker(bins, gguf=model, peer_port=ports[0]), Worker(bins, gguf=model, peer_port=ports[1]),
            Worker(bins, gguf=model)]  # fmt: skip


def test_activations_go_worker_to_worker_with_the_stars_text(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, stock_bins: Binaries, module_children: list[Child]
) -> None:
    kids = module_children
    star = _split(tmp_path / "star", patched_bins, _workers(patched_bins, tiny_model, False), tiny_model, kids)
    try:
        text_star, star_w = _through_host(star, N)
    finally:
        stop_split(star)
    ring = _split(tmp_path / "ring", patched_bins, _workers(patched_bins, tiny_model, True), tiny_model, kids)
    try:
        text_ring, ring_w = _through_host(ring, N)
        logs = [(tmp_path / "ring" / f"rpc{i}.log").read_text() for i in range(3)]
        llama_log = (tmp_path / "ring" / "llama.log").read_text()
    finally:
        stop_split(ring)
    assert text_ring == text_star
    # rpc0 linked to rpc1 (the key llama-server made, from rpc0's address only); the last device was never asked
    assert "peer link to 127.0.0.1:" in logs[0] and "connected" in logs[0], logs[0][-2000:]
    assert "the host allows a predecessor at 127.0.0.1" in logs[1] and "peer link accepted" in logs[1]
    assert "peer link" not in logs[2]
    assert llama_log.count(": server to server") == 1, llama_log[-3000:]
    # what llama-server's process carried for the two workers per token. The star brings each boundary's hidden
    # state back from rpc0 and sends it on to rpc1; worker to worker, rpc0 sends nothing back but small replies.
    # (Each worker still gets its own inputs every token, the same for both: positions and attention masks, ~7 KB a
    # token each on this model, where a hidden state is 2.5 KB: so the total falls less than the hidden states do.)
    ratio = _total(ring_w) / _total(star_w)
    print(f"\nbytes through llama-server per token, 2 workers: star {_total(star_w) / N:.0f}, worker to worker "
          f"{_total(ring_w) / N:.0f} ({ratio:.2f} of the star's); back from rpc0: {star_w[0].bytes_down / N:.0f} "
          f"-> {ring_w[0].bytes_down / N:.0f}")  # fmt: skip
    assert ring_w[0].bytes_down <= 0.3 * star_w[0].bytes_down, (ring_w[0], star_w[0])
    assert ring_w[0].commands[Cmd.PEER_SEND] == ring_w[1].commands[Cmd.PEER_RECV] >= N
    assert ratio <= 0.9, (ring_w, star_w)

    # patch 0013: the token embedding on rpc0 with layer 0 (as mesh-llm runs it): rpc0 gets a token id, not the
    # embedding's row (n_embd floats) per token, loads the matrix from its own file, and the text is the same
    env = {"LLAMA_INPUT_ON_FIRST_RPC": "1"}
    embd = _split(tmp_path / "embd", patched_bins, _workers(patched_bins, tiny_model, True), tiny_model, kids, env)
    try:
        text_embd, embd_w = _through_host(embd, N)
        pushed = embd.load[0].bytes_up
        said = (tmp_path / "embd" / "llama.log").read_text()
        assert f"token embedding on 127.0.0.1:{embd.relays[0].port}, with layer 0\n" in said, said[-3000:]
    finally:
        stop_split(embd)
    assert text_embd == text_star
    row = 4 * N_EMBD  # one f32 row of the embedding
    print(f"to rpc0 per token: {ring_w[0].bytes_up / N:.0f} -> {embd_w[0].bytes_up / N:.0f} with the embedding there")
    assert embd_w[0].bytes_up <= ring_w[0].bytes_up - 0.9 * row * N, (embd_w[0], ring_w[0])
    assert pushed < 4 * MB, pushed  # the 170 MB matrix came from rpc0's own copy, not over the wire

    # the same split loaded the stock way (stock binaries: no local files, no peers) gives the same text
    stock = _split(tmp_path / "stock", stock_bins, [Worker(stock_bins) for _ in range(3)], tiny_model, kids)
    try:
        assert stock.complete(PROMPT, N) == text_star
    finally:
        stop_split(stock)


def _traced(trace_prefix: Path, t0: int, t1: int) -> list[list[str]]:
    """Patch 0015's trace of llama-server in [t0, t1], in time order: (ns, thread, event, cmd, bytes, tag, peer)."""
    return sorted(
        (a for f in trace_prefix.parent.glob(trace_prefix.name + ".*") for ln in f.read_text().splitlines()
         if not ln.startswith("#") and len(a := ln.split()) == 7 and t0 <= int(a[0]) <= t1),
        key=lambda a: int(a[0]),
    )  # fmt: skip


def _waits_per_token(trace_prefix: Path, t0: int, t1: int, n: int) -> float:
    """How often llama-server's thread blocked on a connection (W1 events) in [t0, t1], per token."""
    return sum(1 for a in _traced(trace_prefix, t0, t1) if a[2] == "W1") / n


def test_inputs_are_queued_not_waited_for_with_the_same_text(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, module_children: list[Child]
) -> None:
    """2, patch 0016: the inputs llama-server sets on each server every token are queued (the message
    holds a copy) and a synchronize with nothing queued returns at once: its thread blocks on the connections a
    few times a token, not ~20 times per server; the text is the same with it off (GGML_RPC_QUEUE_INPUTS=0)."""
    got: dict[str, tuple[str, float]] = {}
    for name, extra in (("queued", {}), ("waited", {"GGML_RPC_QUEUE_INPUTS": "0"})):
        prefix = tmp_path / name / "trace"
        prefix.parent.mkdir()
        env = {"GGML_RPC_TRACE": str(prefix), **extra}
        s = _split(tmp_path / name, patched_bins, _workers(patched_bins, tiny_model, True), tiny_model,
                   module_children, env)  # fmt: skip
        try:
            s.complete(PROMPT, 4)
            t0 = time.monotonic_ns()  # CLOCK_MONOTONIC, the trace's steady clock
            text = s.complete(PROMPT, N)
            t1 = time.monotonic_ns()
            time.sleep(0.3)  # the trace is written every 50 ms
        finally:
            stop_split(s)
        got[name] = (text, _waits_per_token(prefix, t0, t1, N))
    print(f"\nllama-server's thread blocked on a connection per token: {got['queued'][1]:.1f} queued, "
          f"{got['waited'][1]:.1f} waited for")  # fmt: skip
    assert got["queued"][0] == got["waited"][0]
    assert got["queued"][1] <= 0.5 * got["waited"][1], got


LONG = " ".join(f"Line {i}: the keeper climbed the stairs, trimmed the wick, wrote the weather." for i in range(60))


def _prefill(s: Split, prompt: str, n: int) -> tuple[str, float]:
    """A greedy answer of ``n`` tokens to ``prompt`` and llama-server's own prompt speed (tok/s)."""
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    return str(out["content"]), float(out["timings"]["prompt_per_second"])


def _overlapped(trace_prefix: Path, t0: int, t1: int) -> int:
    """From llama-server's trace over [t0, t1]: how many micro-batches its thread queued to the first server
    (a graph compute, peer 0) before the second server (peer 1) had answered the boundary read of the micro-batch
    before. 0: each waited for the chain; more: a prompt's micro-batches overlap across the servers. A boundary read
    is the read queued right after a compute on the same server (llama-server reads other things: checkpoints)."""
    lines = _traced(trace_prefix, t0, t1)
    queued = [a for a in lines if a[2] == "Q"]
    boundary = [a[3] == "8" and b[3] in ("10", "16") and a[6] == b[6] for b, a in itertools.pairwise(queued)]
    reads1 = [ok for ok, a in zip(boundary, queued[1:], strict=True) if a[3] == "8" and a[6] == "1"]
    answered1 = [int(a[0]) for a in lines if a[2] == "S1" and a[3] == "8" and a[6] == "1"]  # in order, per connection
    done = [t for ok, t in zip(reads1, answered1, strict=False) if ok]  # each boundary read's answer
    computes0 = [int(a[0]) for a in queued if a[3] in ("10", "16") and a[6] == "0"]
    return sum(1 for k, t in enumerate(computes0[1:]) if k < len(done) and t < done[k])


def test_a_prompt_s_micro_batches_overlap_across_servers_through_llama_server(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, module_children: list[Child]
) -> None:
    """1, patch 0017 on CPU: at a boundary between two rpc-servers without a link (the star), the read
    from one is queued and answered straight into the write queued to the next, so llama-server's thread goes on
    queueing a prompt's micro-batches while the servers compute (stock: it waited for each boundary's read, the
    whole chain before it). Same text with it off (GGML_SCHED_STAGED_COPIES=0); the prompt speeds are printed."""
    got: dict[str, tuple[str, float, int]] = {}
    for name, extra in (("staged", {}), ("waited", {"GGML_SCHED_STAGED_COPIES": "0"})):
        prefix = tmp_path / name / "trace"
        prefix.parent.mkdir()
        env = {"LLAMA_INPUT_ON_FIRST_RPC": "0", "GGML_RPC_TRACE": str(prefix), **extra}
        # micro-batches of 256: each one grows the KV view, so llama.cpp never reuses a prompt's graph (a reused graph
        # synchronizes every backend first, upstream's rule under pipeline parallelism)
        s = start_split(tmp_path / name, patched_bins, _workers(patched_bins, tiny_model, False), tiny_model,
                        module_children, [], env=env, threads=1, tensor_split=SPLIT, counted=False,
                        extra=["--fit", "off", "--ctx-size", "2048", "--ubatch-size", "256"])  # fmt: skip
        try:
            _prefill(s, PROMPT, 2)
            t0 = time.monotonic_ns()  # CLOCK_MONOTONIC, the trace's steady clock
            text, speed = _prefill(s, LONG, 4)
            t1 = time.monotonic_ns()
            time.sleep(0.3)  # the trace is written every 50 ms
        finally:
            stop_split(s)
        got[name] = (text, speed, _overlapped(prefix, t0, t1))
    print(f"\nprompt tok/s (CPU, 3 rpc-servers of one thread, 256-token micro-batches): staged "
          f"{got['staged'][1]:.0f}, waited {got['waited'][1]:.0f}; micro-batches queued before the last one left the "
          f"second server: {got['staged'][2]} vs {got['waited'][2]}")  # fmt: skip
    assert got["staged"][0] == got["waited"][0]
    assert got["waited"][2] == 0, got
    assert got["staged"][2] >= 1, got


def test_a_shorter_micro_batch_asks_no_server_its_allocation_sizes(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, module_children: list[Child]
) -> None:
    """Patch 0019: llama-server asks each rpc-server the allocation size of every new output shape of some ops
    (GET_ALLOC_SIZE), a round trip behind every graph queued before it: at a prompt's last, shorter micro-batch the
    pipeline drained. Where the server answered "no extra" (ggml_nbytes) for a shape no smaller in any outer
    dimension (the reserve's full micro-batch), the client now sizes a smaller one itself: prompts of lengths never
    seen ask nothing. With GGML_RPC_ALLOC_SIZE_DERIVE=0 they ask; same text, and every buffer the servers allocate is
    the same size both ways (a first version gave a smaller tensor a larger one's size: a weight of 640 columns,
    which the client asks about too, took the token embedding's, 4× the last server's memory)."""
    got: dict[str, tuple[list[str], int, list[int]]] = {}
    prompts = [PROMPT + " and the sea", LONG[:700]]  # lengths no graph of this llama-server had
    for name, env in (("derived", {}), ("asked", {"GGML_RPC_ALLOC_SIZE_DERIVE": "0"})):
        s = _split(tmp_path / name, patched_bins, _workers(patched_bins, tiny_model, True), tiny_model,
                   module_children, env=env, ctx=2048)  # fmt: skip
        try:
            s.complete(PROMPT, 4)  # warm-up
            before = [r.snapshot() for r in s.relays]
            texts = [s.complete(p, 8) for p in prompts]
            after = [r.snapshot().minus(b) for r, b in zip(s.relays, before, strict=True)]
            asked = sum(a.commands[Cmd.GET_ALLOC_SIZE] for a in after)
            allocated = [r.snapshot().allocated for r in s.relays]  # every ALLOC_BUFFER since the start
        finally:
            stop_split(s)
        got[name] = (texts, asked, allocated)
    print(f"\nGET_ALLOC_SIZE round trips for two prompts of new lengths: {got['derived'][1]} vs {got['asked'][1]} off")
    assert got["derived"][0] == got["asked"][0]
    assert got["derived"][2] == got["asked"][2], got
    assert got["asked"][1] > 0, got
    assert got["derived"][1] == 0, got


def test_a_stock_rpc_server_gets_the_star(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, stock_bins: Binaries, module_children: list[Child]
) -> None:
    """Interop: llama-server names a peer listener for a stock rpc-server (which ignores GGML_RPC_PEER_LISTEN and says
    nothing of peers in HELLO): that boundary goes through llama-server as before, with the same text."""
    workers = _workers(patched_bins, tiny_model, True)
    workers[1] = Worker(stock_bins, peer_port=free_port())  # the successor is stock
    mixed = _split(tmp_path / "mixed", patched_bins, workers, tiny_model, module_children)
    try:
        text, _ = _through_host(mixed, N)
        llama_log = (tmp_path / "mixed" / "llama.log").read_text()
    finally:
        stop_split(mixed)
    assert "server to server" not in llama_log
    assert "peer link to" not in (tmp_path / "mixed" / "rpc0.log").read_text()
    ring = _split(tmp_path / "ring2", patched_bins, _workers(patched_bins, tiny_model, True), tiny_model,
                  module_children)  # fmt: skip
    try:
        assert ring.complete(PROMPT, N) == text
    finally:
        stop_split(ring)


def test_the_inputs_workers_get_each_token_stay_flat_as_the_context_grows(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, module_children: list[Child]
) -> None:
    """(patch 0014): worker to worker, what llama-server still sends each worker every token is its
    graph inputs — the KQ masks (n_kv values each, growing with the context) above all. Sent as what changed since the
    last token, the bytes to the workers per generated token stay flat from a short prompt to a ~1,500-token one;
    every input whole (GGML_RPC_DELTA=0, stock's way) they grow. Same greedy text both ways."""
    long_prompt = PROMPT + " " + " ".join(["the quick brown fox jumps over the lazy dog"] * 150)
    got: dict[str, dict[str, tuple[float, str, Counter[int]]]] = {}
    for name, env in (("delta", {}), ("whole", {"GGML_RPC_DELTA": "0"})):
        s = _split(tmp_path / name, patched_bins, _workers(patched_bins, tiny_model, True), tiny_model,
                   module_children, env=env, ctx=4096)  # fmt: skip
        try:
            got[name] = {label: _per_token(s, prompt) for label, prompt in (("short", PROMPT), ("long", long_prompt))}
            commands = sum((r.snapshot().commands for r in s.relays[:2]), Counter[int]())
        finally:
            stop_split(s)
        assert (commands[Cmd.SET_TENSOR_DELTA] > 0) == (name == "delta"), commands
    print({k: {c: (round(v[0]), {Cmd(x).name: round(y) for x, y in v[2].items()}) for c, v in d.items()}
           for k, d in got.items()})  # fmt: skip
    for label in ("short", "long"):
        assert got["delta"][label][1] == got["whole"][label][1]
    d, w = got["delta"], got["whole"]
    assert w["long"][0] >= 1.5 * w["short"][0]  # the masks grow with the context, sent whole
    assert d["long"][0] <= 1.25 * d["short"][0] and d["long"][0] < 0.5 * w["long"][0]


def _per_token(s: Split, prompt: str, n: int = 48) -> tuple[float, str, Counter[int]]:
    """Bytes llama-server sent the two workers per generated token from the third on (the prompt's prefill and the
    first decode graphs are sent by then), less any graph it sent again (GRAPH_COMPUTE: a new shape, once per 256
    cells of context; GRAPH_RECOMPUTE otherwise), the greedy answer, and the payload per command per token."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=300)
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 1, "cache_prompt": False, "stream": True}
    c.request("POST", "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    before: list[WireStats] = []
    text, seen = "", 0
    for line in r:
        if line.startswith(b"data: {"):
            text += json.loads(line[6:])["content"]
            seen += 1
            if seen == 2:
                before = [x.snapshot() for x in s.relays[:2]]
    c.close()
    after = [x.snapshot().minus(b) for x, b in zip(s.relays[:2], before, strict=True)]
    payload = sum((a.payload for a in after), Counter[int]())
    per = {k: v / (n - 2) for k, v in payload.items()}
    return (sum(a.bytes_up for a in after) - payload[Cmd.GRAPH_COMPUTE]) / (n - 2), text, Counter(per)


# ------------------------------------------------------------------ who gets through to a peer listener


def _send(s: socket.socket, cmd: int, payload: bytes) -> None:
    s.sendall(HEADER.pack(cmd, len(payload)) + payload)


def _recv_reply(s: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 8 or len(buf) < 8 + struct.unpack_from("<Q", buf)[0]:
        chunk = s.recv(4096)
        if not chunk:
            raise OSError("closed")
        buf += chunk
    return buf[8:]


def _as_host(port: int) -> socket.socket:
    """An RPC client as llama-server would be (HELLO asking for mesh-llm's capabilities): it must hear CAPS_PEERS."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    _send(s, Cmd.HELLO, GGUF_CAPS_MAGIC + bytes([1]) + bytes(CONN_CAPS_SIZE - 7))
    reply = _recv_reply(s)
    caps = reply[4 : 4 + CONN_CAPS_SIZE]
    assert caps.startswith(GGUF_CAPS_MAGIC) and caps[7] & 2, reply  # bit 1: it has a peer listener
    return s


def _peer_accept(s: socket.socket, identity: str, key: bytes, ip: str) -> bool:
    _send(s, Cmd.PEER_ACCEPT, identity.encode().ljust(32, b"\0") + key + ip.encode().ljust(48, b"\0"))
    return _recv_reply(s) == b"\x01"


def _s_client(port: int, identity: str, key: bytes) -> bool:
    """Whether openssl's TLS 1.3 client with this external PSK completes a handshake with the peer listener."""
    r = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-tls1_3", "-ciphersuites", "TLS_AES_128_GCM_SHA256",
         "-psk_identity", identity, "-psk", key.hex()],
        input=b"", capture_output=True, timeout=30,
    )  # fmt: skip
    said = (r.stdout + r.stderr).decode(errors="replace")
    return "Cipher is TLS_AES_128_GCM_SHA256" in said


def test_only_the_key_the_host_gave_from_the_address_it_named_gets_through(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries, module_children: list[Child]
) -> None:
    """The test plays the host (an RPC client on the loopback listener) of two rpc-servers A and B with peer
    listeners. A stranger (no key, a made-up key), the key meant for A used at B (a member that is not B's
    predecessor), and the right key from another address than the one named are all refused; the right keys from the
    right address get through; once the host's connection is gone, its keys no longer work. (The NAT lab's
    worker-to-worker cell refuses a member at another real address before its handshake.)"""
    assert shutil.which("openssl"), "openssl is installed by scripts/setup test"
    servers = []
    for name in "AB":
        port, peer = free_port(), free_port()
        peer = peer if peer != port else free_port(avoid=[port])
        env = {"GGML_RPC_PEER_LISTEN": f"127.0.0.1:{peer}"}
        c = Child.start(name, rpc_server_argv(patched_bins, port, gguf=tiny_model), tmp_path / f"{name}.log",
                        env={**os.environ, **env})  # fmt: skip
        module_children.append(c)
        wait_tcp_ready(c, port)
        servers.append((c, port, peer))
    (_, a_port, a_peer), (_, b_port, b_peer) = servers
    key_a, key_b = bytes(range(32)), bytes(range(100, 132))
    host_a, host_b = _as_host(a_port), _as_host(b_port)
    with host_a, host_b:
        assert not _s_client(a_peer, "peer-x", key_a)  # before the host names anyone: nobody
        assert _peer_accept(host_a, "peer-a", key_a, "127.0.0.1")
        assert _peer_accept(host_b, "peer-b", key_b, "127.0.0.1")
        assert not _s_client(a_peer, "peer-a", bytes(32))  # a made-up key
        assert not _s_client(b_peer, "peer-a", key_a)  # A's predecessor's key, at B
        assert _s_client(a_peer, "peer-a", key_a)  # the one the host named
        with socket.create_connection(("127.0.0.1", b_peer), timeout=20) as s:  # RPC in the clear
            s.sendall(HEADER.pack(Cmd.HELLO, 0) + bytes(64))
            try:
                reply = s.recv(64)
            except ConnectionResetError:
                reply = b""
            assert reply == b"" or reply[0] == 0x15, reply  # closed, or a TLS alert record
        # the right key, but the host named another address for it
        assert _peer_accept(host_a, "peer-a2", key_a, "10.9.9.9")
        assert not _s_client(a_peer, "peer-a2", key_a)
        # a second predecessor the host names (a later worker may take inputs from two earlier ones): both get in
        assert _peer_accept(host_a, "peer-a3", key_b, "127.0.0.1")
        assert _s_client(a_peer, "peer-a3", key_b) and _s_client(a_peer, "peer-a", key_a)
    # the host's connection closes; the next client (a new llama-server) starts with no predecessor allowed
    with _as_host(b_port):
        assert not _s_client(b_peer, "peer-b", key_b)
    text = (tmp_path / "B.log").read_text()
    assert text.count("peer link refused") >= 3 and "Expected HELLO" not in text, text[-3000:]


# ------------------------------------------------------------------ in the mesh


def test_a_three_node_mesh_sends_activations_worker_to_worker(
    tmp_path: Path, tiny_model: Path, stock_bins: Binaries
) -> None:
    """Two workers reached on the direct path: the host hands llama-server their predecessor listeners, the first
    worker's hidden state goes straight to the second, and the answer is the stock split's."""
    a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        token = (a.state / "token").read_text().strip()
        for name in "bd":  # workers with room for some of the layers each
            nodes.append(NodeProc(tmp_path, name, tiny_model, "--max-vram", "0.07", "--ctx-size", "1024",
                                  "--join", token))  # fmt: skip
        wait_for(lambda: serves(a, 3), 180, "a 3-way split")
        plan = _assignments(a)
        workers = [str(x["node"]) for x in plan[:2]]
        paths = [_rpc_path(a, w) for w in workers]
        assert all(p.startswith("direct 127.0.0.1:") for p in paths), paths
        out = text_of(complete(a.port, "/v1/completions"))
        counts = [float(x["count"]) for x in plan]  # type: ignore[arg-type]
        assert out == stock_split_text(tmp_path, stock_bins, tiny_model, counts, SPLIT_N)
        first, second = (p.split()[1] for p in paths)
        said = a.text_of("llama-server.log")
        assert f"rpc peer link {first} -> {second}: server to server" in said, said[-3000:]
        # mesh-llm status says so for the first worker, and only for it
        wait_for(lambda: "straight to the next worker" in _rpc_path(a, workers[0]), 10, "the status to say so")
        assert "straight" not in _rpc_path(a, workers[1])
        logs = {n.state.name: n.text_of("rpc-server.log") for n in nodes[1:]}
        assert sum("peer link accepted" in t for t in logs.values()) == 1, logs
        assert sum("connected" in t for t in logs.values()) == 1, logs
    finally:
        for n in nodes:
            n.stop()


def test_workers_behind_tunnels_send_activations_worker_to_worker_through_the_mesh(
    tmp_path: Path, tiny_model: Path, stock_bins: Binaries
) -> None:
    """Where no direct path exists (the host on ``--rpc-path tunnel``: every worker through its QUIC
    tunnel): the host asks the first worker for a loopback port that leads to the second over the mesh, and the
    hidden state goes that way, TLS with llama-server's key inside; the same text as the stock split. A member that
    is not the first worker, and a stranger, get nothing from the second worker; a member that is not the host gets
    no forwarder from the first."""
    import asyncio

    from meshllm.net.conn import STREAM_PEER, STREAM_PEER_OPEN
    from meshllm.net.endpoint import Endpoint
    from meshllm.proto import crypto
    from meshllm.proto import token as tok
    from meshllm.proto.auth import AuthWelcome, make_proof
    from tests.integration.test_mesh import _handshake_as

    a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024", "--rpc-path", "tunnel")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        token = (a.state / "token").read_text().strip()
        for name in "bd":
            nodes.append(NodeProc(tmp_path, name, tiny_model, "--max-vram", "0.07", "--ctx-size", "1024",
                                  "--join", token))  # fmt: skip
        wait_for(lambda: serves(a, 3), 180, "a 3-way split")
        plan = _assignments(a)
        workers = [str(x["node"]) for x in plan[:2]]
        assert all(_rpc_path(a, w).startswith("tunnel") for w in workers), [_rpc_path(a, w) for w in workers]
        out = text_of(complete(a.port, "/v1/completions"))
        counts = [float(x["count"]) for x in plan]  # type: ignore[arg-type]
        assert out == stock_split_text(tmp_path, stock_bins, tiny_model, counts, SPLIT_N)
        said = a.text_of("llama-server.log")
        link = r"(?m)^rpc peer link 127\.0\.0\.1:\d+ -> 127\.0\.0\.1:\d+: server to server$"
        assert re.search(link, said), said[-3000:]
        wait_for(lambda: "next worker through the mesh" in _rpc_path(a, workers[0]), 10, "the status to say so")
        assert "next worker" not in _rpc_path(a, workers[1])
        by_id = {crypto.node_id(n.key()).hex(): n for n in nodes}
        first, second = by_id[workers[0]], by_id[workers[1]]
        assert "peer link accepted" in second.text_of("rpc-server.log")
        assert re.search(r"peer link to 127\.0\.0\.1:\d+: connected", first.text_of("rpc-server.log"))

        # the attempts: a member (admitted with a worker-scoped token) and a stranger
        minted = subprocess.run([sys.executable, "-m", "meshllm.cli", "token", "--state-dir", str(a.state), "--scope",
                                 "worker"], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert minted.returncode == 0, minted.stderr
        member_token = tok.parse(minted.stdout.strip().splitlines()[-1])
        addr_of = {n: json.loads((n.state / "node.json").read_text())["addrs"][0] for n in (first, second)}

        async def attempts() -> tuple[bytes, bytes, bytes]:
            async def member_to(n: NodeProc) -> Any:
                key = crypto.new_key()
                ep = Endpoint(key)
                await ep.open("127.0.0.1", 0)
                n_id = crypto.node_id(n.key())
                welcome, _, conn = await _handshake_as(
                    ep, addr_of[n], n_id, member_token.mesh_id,
                    lambda k, ch: make_proof(k, member_token.secret, ch, n_id, token=member_token), key)  # fmt: skip
                assert isinstance(welcome, AuthWelcome), welcome
                conn.peer = n_id
                conn.set_authenticated()
                return ep, conn

            async def read(st: Any) -> bytes:
                try:
                    return bytes(await asyncio.wait_for(st.read(), 10))
                except (ConnectionError, TimeoutError):
                    return b""

            ep1, c1 = await member_to(second)  # not the worker before it: its hidden state is refused
            peer = c1.open_stream(STREAM_PEER)
            peer.write(b"\x16\x03\x01")  # the first bytes of a TLS ClientHello
            ep2, c2 = await member_to(first)  # not the host: no forwarder
            ask = c2.open_stream(STREAM_PEER_OPEN)
            ask.write(crypto.node_id(second.key()), end=True)
            ep3 = Endpoint(crypto.new_key())  # a stranger: dials, never authenticates
            await ep3.open("127.0.0.1", 0)
            host, port = addr_of[second].rsplit(":", 1)
            c3 = await ep3.dial((host, int(port)), crypto.node_id(second.key()))
            stranger = c3.open_stream(STREAM_PEER)
            stranger.write(b"\x16\x03\x01")
            try:
                return await read(peer), await read(ask), await read(stranger)
            finally:
                for ep in (ep1, ep2, ep3):
                    ep.close()

        seen = second.text_of("rpc-server.log")
        assert asyncio.run(attempts()) == (b"", b"", b"")
        time.sleep(1)
        after = second.text_of("rpc-server.log")
        assert after.count("peer link") == seen.count("peer link"), after[-2000:]  # no byte reached its listener
        wait_for(lambda: "refused a worker-to-worker stream from" in second.text(), 10, "the second worker to say")
        wait_for(lambda: "refused a worker-to-worker link asked by" in first.text(), 10, "the first worker to say")
        assert text_of(complete(a.port, "/v1/completions")) == out
    finally:
        for n in nodes:
            n.stop()


def test_a_listener_that_cannot_be_made_fails_the_start(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries
) -> None:
    """rpc-server's peer or TLS listener on a port already taken: it says so and exits 1 (it exited 0 before, which
    mesh-llm's supervisor reported as a clean exit)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        for var, said in (("GGML_RPC_PEER_LISTEN", "Failed to create peer server socket"),
                          ("GGML_RPC_TLS_LISTEN", "Failed to create TLS server socket")):  # fmt: skip
            argv = rpc_server_argv(patched_bins, free_port(), gguf=tiny_model)
            r = subprocess.run(argv, env={**os.environ, var: busy}, capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and said in r.stderr, (r.returncode, r.stderr[-2000:])
