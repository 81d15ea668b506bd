"""The direct RPC path: a host reaches its worker's rpc-server over TCP + TLS 1.3 with a pre-shared key
the worker handed it over the mesh, the tunnel staying as the fallback. Real nodes, real patched binaries, and
openssl's own client as the stranger and as the key holder (so the TLS is standard TLS 1.3, not a private format)."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from meshllm.llama.build import Binaries
from meshllm.llama.processes import free_port, port_in_use

from .meshlab import NodeProc, serves, wait_for
from .splitlab import stock_split_text
from .test_serve_split import N, _assignments, complete, text_of, two_nodes

HELLO = bytes([14]) + struct.pack("<Q", 0)  # an RPC command byte + size, as a stranger would send


def _rpc_path(host: NodeProc, worker: str) -> str:
    """How the host reaches ``worker``, without the note on the token embedding (patch 0013: where the first worker
    holds it, status says so once llama-server has logged it, so whether it shows depends on when status is read)."""
    peer = next(p for p in host.status()["peers"] if p["node"] == worker)  # type: ignore[attr-defined]
    return str(peer.get("rpc_path") or "").replace(", with the token embedding", "")


def _s_client(port: int, identity: str, key_hex: str) -> str:
    """openssl's TLS 1.3 client with an external PSK; what it printed."""
    r = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-tls1_3", "-ciphersuites", "TLS_AES_128_GCM_SHA256",
         "-psk_identity", identity, "-psk", key_hex],
        input=b"", capture_output=True, timeout=30,
    )  # fmt: skip
    return (r.stdout + r.stderr).decode(errors="replace")


def test_a_split_goes_direct_with_tls_and_only_the_host_gets_through(
    tmp_path: Path, tiny_model: Path, stock_bins: Binaries
) -> None:
    assert shutil.which("openssl"), "openssl is installed by scripts/setup test"
    port = free_port("0.0.0.0")  # --rpc-port: the worker's TLS port, as a firewall would need it fixed
    while port_in_use(port + 1, "0.0.0.0"):  # and PORT+1, its listener for worker-to-worker links
        port = free_port("0.0.0.0")
    with two_nodes(tmp_path, tiny_model, ("--max-vram", "0.446"), ("--max-vram", "0.3", "--rpc-port", str(port))) as (
        a,
        b,
    ):
        wait_for(lambda: serves(a, 2), 120, "a two-way split")
        worker = str(_assignments(a)[0]["node"])
        path = _rpc_path(a, worker)
        assert path == f"direct 127.0.0.1:{port} (TLS)", path
        assert f"peer endpoint  : [::]:{port + 1}" in b.text_of("rpc-server.log")  # fixed too, for a firewall
        # the same answer as the same split loaded the stock way (stock binaries, plain TCP, weights pushed)
        counts = [float(x["count"]) for x in _assignments(a)]  # type: ignore[arg-type]
        out = text_of(complete(a.port, "/v1/completions"))
        assert out == stock_split_text(tmp_path, stock_bins, tiny_model, counts, N)
        # nothing went through the tunnel: the RPC bytes took the direct path
        peer = next(p for p in a.status()["peers"] if p["node"] == worker)  # type: ignore[attr-defined]
        assert peer["tunnel"]["rpc_sent"] == 0, peer["tunnel"]  # type: ignore[index]

        keys = (b.state / "rpc-server.keys").read_text().split()
        # one identity, the one address it may be used from (the host's: patch 0008), a 32-byte key
        assert len(keys) == 3 and keys[1] == "127.0.0.1" and len(keys[2]) == 64, keys
        keys = [keys[0], keys[2]]
        # the key file is the worker's secret: mode 0600, and its key is in no log
        assert (b.state / "rpc-server.keys").stat().st_mode & 0o077 == 0
        for n in (a, b):
            for log in n.state.glob("*.log"):
                assert keys[1] not in log.read_text(errors="replace"), log

        # the host's llama-server dies: restarted on the same path and key, the same answer
        said: list[str] = []
        watching = threading.Event()

        def watch() -> None:  # what the worker's /health says meanwhile
            while not watching.is_set():
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{b.port}/health", timeout=5).read()
                except urllib.error.HTTPError as e:
                    said.append(json.loads(e.read()).get("reason", ""))
                except OSError:
                    pass
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        a.kill_child("llama-server")
        wait_for(lambda: "restarting" in a.text(), 30, "the restart")
        # the death is in the timeline (what the console shows) and counted in /metrics
        def timeline() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{a.port}/mesh/status", timeout=10) as r:
                return " | ".join(e["text"] for e in json.loads(r.read())["events"])

        wait_for(lambda: "llama-server exited (SIGKILL): restarting it" in timeline(), 10, "the death in the timeline")
        with urllib.request.urlopen(f"http://127.0.0.1:{a.port}/metrics", timeout=10) as r:
            assert "mesh_llm_child_restarts_total 1" in r.read().decode()
        wait_for(lambda: "llama-server ready" in a.text().split("restarting")[-1], 120, "llama-server back")
        watching.set()
        watcher.join()
        # every node says the host restarts a crashed llama-server (the record said "serving" through it)
        # ("restarting it" at once, then the supervisor's own "restarting in 1 s": a watcher may see either)
        crash = f"the host {a.short()} is loading: llama-server exited (SIGKILL); restarting"
        assert any(r.startswith(crash) for r in said), said
        wait_for(lambda: "llama-server serves again" in a.text(), 30, "the host to say it serves again")
        assert a.text().count("ready: http://") == 1, a.text()  # not "ready" and the agent lines all over again
        assert text_of(complete(a.port, "/v1/completions")) == out
        assert _rpc_path(a, worker) == path

        # the host leaves: the worker withdraws its key at once (the rpc-server serves one client at a time, so
        # the checks below run once the host's connection is gone)
        a.stop()
        wait_for(lambda: (b.state / "rpc-server.keys").read_text() == "", 60, "the key withdrawn")
        refused = b.text_of("rpc-server.log").count("TLS client refused")
        # a stranger speaking RPC in the clear: the TLS listener refuses it; not one RPC byte is parsed
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(HELLO + bytes(64))
            try:
                reply = s.recv(64)
            except ConnectionResetError:
                reply = b""
        assert reply == b"" or reply[0] == 0x15, reply  # closed, or a TLS alert record
        # openssl with the former host's identity and key, and with a made-up key: both refused
        for key_hex in (keys[1], "00" * 32):
            said = _s_client(port, keys[0], key_hex)
            assert "Cipher is (NONE)" in said or "TLSv1.3" not in said, said
        wait_for(lambda: b.text_of("rpc-server.log").count("TLS client refused") >= refused + 3, 30, "3 refusals")
        assert "Expected HELLO" not in b.text_of("rpc-server.log")  # the RPC parser never saw their bytes
    # shutting down while a peer is gone prints no traceback (a dial to the departed host was under way)
    for n in (a, b):
        assert "Traceback" not in n.text() and "never retrieved" not in n.text(), n.text()[-2000:]


def test_rpc_path_tunnel_keeps_every_byte_in_the_mesh(tmp_path: Path, tiny_model: Path) -> None:
    """A worker started with --rpc-path tunnel opens no TLS listener and says so when its (default) host asks for a
    key: the split runs through the QUIC tunnel, without the host waiting on the worker."""
    with two_nodes(tmp_path, tiny_model, ("--max-vram", "0.446"), ("--max-vram", "0.3", "--rpc-path", "tunnel")) as (
        a,
        b,
    ):
        wait_for(lambda: serves(a, 2), 120, "a two-way split")
        worker = str(_assignments(a)[0]["node"])
        assert _rpc_path(a, worker) == "tunnel"
        assert "TLS endpoint" not in b.text_of("rpc-server.log")
        assert "(it offers none): tunnel" in a.text()
        assert text_of(complete(a.port, "/v1/completions")).strip()


def test_a_member_that_is_not_the_host_gets_neither_a_key_nor_a_tunnel(tmp_path: Path, tiny_model: Path) -> None:
    """A real member (joined with the host's own token, in this process) asks the worker for its direct path's key
    and opens an RPC tunnel to it, RPC bytes ready: both streams are reset, not one byte comes back, the worker logs
    both refusals — and the host's split goes on serving."""
    import asyncio

    from meshllm.net.conn import STREAM_RPC, STREAM_RPC_KEY
    from meshllm.net.meshnet import MeshNet
    from meshllm.proto import crypto
    from meshllm.proto import token as tok

    with two_nodes(tmp_path, tiny_model, ("--max-vram", "0.446"), ("--max-vram", "0.3")) as (a, b):
        wait_for(lambda: serves(a, 2), 120, "a two-way split")
        worker = bytes.fromhex(str(_assignments(a)[0]["node"]))
        token = tok.parse((a.state / "token").read_text().strip())
        state = tmp_path / "intruder"
        state.mkdir(mode=0o700)

        async def intrude() -> tuple[str, dict[int, bytes]]:
            net = MeshNet(crypto.new_key(), None, state, bind=("127.0.0.1", 0))
            await net.start()
            try:
                await net.join(token)
                async with asyncio.timeout(30):
                    while worker not in net.peers:  # the mesh connects members to each other
                        await asyncio.sleep(0.1)
                got: dict[int, bytes] = {}
                for kind in (STREAM_RPC_KEY, STREAM_RPC):
                    st = net.peers[worker].open_stream(kind)
                    st.write(HELLO + bytes(64))
                    data = b""
                    async with asyncio.timeout(10):
                        while chunk := await st.read():
                            data += chunk
                    got[kind] = data
                return crypto.short(net.me), got
            finally:
                await net.stop(leave=True)

        who, got = asyncio.run(intrude())
        assert got == {STREAM_RPC_KEY: b"", STREAM_RPC: b""}, got
        assert f"refused an RPC key to {who}: not the elected host" in b.text()
        assert f"refused an RPC tunnel from {who}: not the elected host" in b.text()
        assert text_of(complete(a.port, "/v1/completions")).strip()  # the host's path is untouched


def test_netem_delays_the_direct_path_too(tmp_path: Path, tiny_model: Path) -> None:
    """MESH_LLM_NETEM (benchmarks) on a worker: its direct-path and peer listeners sit behind relays that delay each
    way by rtt/2 (meshllm.delaytcp), so the host's direct TCP + TLS path pays the round trip as the tunnels do: every
    generated token crosses the link out and back at least once, so decode is no faster than 1000 / rtt tokens a
    second. The path stays direct and the answer is the undelayed split's."""
    rtt = 250.0
    (tmp_path / "plain").mkdir()
    with two_nodes(tmp_path / "plain", tiny_model, ("--max-vram", "0.446"), ("--max-vram", "0.3")) as (a, _):
        wait_for(lambda: serves(a, 2), 120, "a two-way split")
        plain = complete(a.port, "/v1/completions")
    b_env = {"MESH_LLM_NETEM": f"rtt={rtt}"}
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--max-vram", "0.446")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
        nodes.append(NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--max-vram", "0.3", "--join",
                              (a.state / "token").read_text().strip(), env=b_env))  # fmt: skip
        wait_for(lambda: serves(a, 2), 180, "a two-way split, delayed")
        worker = str(_assignments(a)[0]["node"])
        assert _rpc_path(a, worker).startswith("direct 127.0.0.1:"), _rpc_path(a, worker)
        delayed = complete(a.port, "/v1/completions")
    finally:
        for n in nodes:
            n.stop()
    assert text_of(delayed) == text_of(plain)
    speed = [float(x["timings"]["predicted_per_second"]) for x in (plain, delayed)]  # type: ignore[index]
    print(f"\ndecode tok/s: {speed[0]:.1f} undelayed, {speed[1]:.1f} at {rtt:.0f} ms RTT on the direct path")
    assert speed[1] <= 1000 / rtt, speed
    assert speed[0] > 1000 / rtt, speed  # the bound above says something on this machine
