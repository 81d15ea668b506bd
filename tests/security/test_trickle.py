"""A stranger stalls a split, performed against real nodes. The worker's rpc-server did the TLS
handshake inside its one accept loop with a limit per recv(): a client sending one byte every 2 s held the loop for
ever, and at the next llama-server start (a crash, a re-plan) the split could not load — the host answered 503 for as
long as the stranger trickled, the tunnel fallback hung too. Now handshakes run beside the accept loop, each with a
3 s deadline, and a key is good from its host's address only (patch 0008)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

from meshllm.llama.build import Binaries
from meshllm.llama.supervisor import RpcServer
from tests.integration.meshlab import NodeProc, split_pair, wait_for
from tests.integration.test_rpc_direct import _s_client
from tests.integration.test_serve_split import complete, text_of


def _trickle(port: int, stop: threading.Event, sent: list[int]) -> None:
    """A TLS record header announcing 512 bytes, then one byte every 2 s (each under the old per-recv limit);
    a new connection whenever the server drops one."""
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(bytes([0x16, 0x03, 0x01, 0x02, 0x00]))
                while not stop.wait(2.0):
                    s.sendall(b"\x01")
                    sent[0] += 1
        except OSError:
            stop.wait(0.2)


def test_a_trickling_stranger_does_not_stall_the_split(tmp_path: Path, tiny_model: Path) -> None:
    nodes: list[NodeProc] = []
    stop = threading.Event()
    try:
        a, b = split_pair(tmp_path, tiny_model, nodes)
        worker = next(p for p in a.status()["peers"] if p["short"] == b.short())  # type: ignore[attr-defined]
        path = str(worker.get("rpc_path") or "")
        assert path.startswith("direct 127.0.0.1:"), path
        port = int(path.split(":")[1].split()[0])
        before = text_of(complete(a.port, "/v1/completions"))
        sent = [0]
        threads = [threading.Thread(target=_trickle, args=(port, stop, sent), daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(3)  # the strangers are in the queue before the host's next connection
        a.kill_child("llama-server")  # the next llama-server start must get through
        t0 = time.monotonic()
        wait_for(lambda: "restarting" in a.text(), 30, "the restart")
        wait_for(lambda: "llama-server ready" in a.text().split("restarting")[-1], 60, "llama-server back")
        took = time.monotonic() - t0
        print(f"\nllama-server back {took:.1f} s after its kill, 3 strangers trickling ({sent[0]} bytes)")
        assert text_of(complete(a.port, "/v1/completions")) == before
        assert took < 30 and sent[0] > 0
    finally:
        stop.set()
        for n in nodes:
            n.stop()


def test_a_key_is_good_from_its_hosts_address_only(patched_bins: Binaries, tiny_model: Path, tmp_path: Path) -> None:
    """The key file names the address of the host that asked for the key: the right key from any other address
    is refused before its handshake (openssl's own TLS 1.3 client with the external PSK, as in test_rpc_direct)."""
    keys = tmp_path / "keys"
    key = "ab" * 32
    srv = RpcServer(patched_bins, tiny_model, tmp_path, keys_file=keys)

    async def check() -> None:
        srv.start()
        try:
            await srv.wait_ready()
            assert srv.tls_port is not None
            for ip, ok in (("127.0.0.2", False), ("127.0.0.1", True)):
                keys.write_text(f"host-1 {ip} {key}\n")
                said = await asyncio.to_thread(_s_client, srv.tls_port, "host-1", key)
                assert ("Cipher is TLS_AES_128_GCM_SHA256" in said) == ok, (ip, said[-600:])
        finally:
            await srv.stop()

    asyncio.run(check())
    assert "TLS client refused: no key for its address 127.0.0.1" in (tmp_path / "rpc-server.log").read_text()
