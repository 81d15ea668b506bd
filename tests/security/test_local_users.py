"""Other users of the same machine: the host's loopback tunnel listeners (llama-server's way to the workers'
rpc-servers), a worker's rpc-server (the tunnels' far end) and the web console (it hands out the invite token) serve
our own user only. Acting as another user needs root (CI runs as root)."""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401  (loaded before the fork: the child, as nobody, may not read the stdlib)
import os
import socket
from pathlib import Path

import pytest

from meshllm.llama import rpcwire
from meshllm.llama.build import Binaries
from meshllm.llama.processes import Child, free_port, rpc_server_argv, wait_tcp_ready
from meshllm.llama.rpcwire import CONN_CAPS_SIZE, HEADER, Cmd
from meshllm.net.tunnel import TunnelListener, TunnelStats

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user (nobody) needs root")

def _connect_as(uid: int | None, port: int, send: bytes = b"\x0e" + bytes(8)) -> str:
    """In a forked child (running as ``uid`` if given): connect, send ``send`` (an RPC HELLO), say whether anything
    came back ("closed"), or the first line of what did."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no asyncio, no exec (another user may not read our virtualenv)
        try:
            os.close(r)
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(send)
            s.settimeout(10)
            try:
                first = s.recv(4096)
                got = first.split(b"\r\n")[0] if first else b"closed"
            except ConnectionResetError:
                got = b"closed"
            os.write(w, got)
        except BaseException as e:
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_a_tunnel_listener_takes_clients_of_our_own_user_only() -> None:
    """The audit's low finding: any local user could connect to the host's tunnel listeners and speak RPC to the
    workers. A client running as `nobody` is closed before any stream is opened; one of ours gets its stream."""

    async def main() -> None:
        asked: list[int] = []
        listener = TunnelListener(lambda: asked.append(1), TunnelStats())  # type: ignore[arg-type, func-returns-value]
        port = await listener.start()

        try:
            assert await asyncio.to_thread(_connect_as, 65534, port) == "closed" and not asked
            assert await asyncio.to_thread(_connect_as, None, port) == "closed" and asked == [1]  # ours got to ask
        finally:
            await listener.close()

    asyncio.run(main())


def test_the_console_and_its_token_serve_our_own_user_only(tmp_path: Path) -> None:
    """The console's /token would give any local user a host-scoped way into the mesh, and its /approve
    would let any node in."""
    from meshllm.machine.state import save_token
    from meshllm.serve.report.console import Console

    async def main() -> None:
        save_token(tmp_path, "mesh1.secret-token")
        console = Console(lambda: {}, tmp_path, "http://127.0.0.1:1/v1", None)
        port = free_port()
        await console.start(port)
        get = b"GET /token HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        body = b'{"node": "abcd"}'
        post = (b"POST /approve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)  # fmt: skip
        try:
            assert await asyncio.to_thread(_connect_as, 65534, port, get) == "HTTP/1.1 403 Forbidden"
            assert await asyncio.to_thread(_connect_as, None, port, get) == "HTTP/1.1 200 OK"
            assert await asyncio.to_thread(_connect_as, 65534, port, post) == "HTTP/1.1 403 Forbidden"
            # ours gets to the approval itself (no node waits here: a one-line refusal, not a 403)
            assert await asyncio.to_thread(_connect_as, None, port, post) == "HTTP/1.1 400 Bad Request"
        finally:
            await console.stop()

    asyncio.run(main())


def test_a_workers_rpc_server_takes_loopback_clients_of_our_own_user_only(
    patched_bins: Binaries, tmp_path: Path, children: list[Child]
) -> None:
    """The patched rpc-server's plain listener is on loopback (the worker's tunnels end there): another user of the
    worker's machine could speak RPC to it and own the machine. Patch 0006: such a client is refused at accept, the
    server goes on serving ours."""
    port = free_port()
    srv = Child.start("rpc", rpc_server_argv(patched_bins, port, threads=1), tmp_path / "rpc.log")
    children.append(srv)
    wait_tcp_ready(srv, port)
    hello = HEADER.pack(Cmd.HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE)
    assert _connect_as(65534, port, hello) == "closed"
    assert rpcwire.hello(port)[0] >= 3  # ours: a protocol version back
    assert srv.alive() and "refused a loopback client of another user (uid 65534)" in (tmp_path / "rpc.log").read_text()


def test_a_refused_local_client_does_not_block_the_tls_listener(
    patched_bins: Binaries, tmp_path: Path, children: list[Child]
) -> None:
    """After refusing another user's plain client, the server waited for the next plain client and
    took no TLS client meanwhile (patch 0006 accepted in a loop of its own). Patch 0008: one loop for both."""
    from tests.integration.test_rpc_direct import _s_client

    port, tls_port = free_port(), free_port("0.0.0.0")
    keys = tmp_path / "keys"
    keys.write_text(f"host-1 {'cd' * 32}\n")  # any address (a row both builds read)
    env = {"GGML_RPC_TLS_LISTEN": f"0.0.0.0:{tls_port}", "GGML_RPC_TLS_SERVER_KEYS": str(keys)}
    srv = Child.start("rpc", rpc_server_argv(patched_bins, port, threads=1), tmp_path / "rpc.log", env=env)
    children.append(srv)
    wait_tcp_ready(srv, port)
    hello = HEADER.pack(Cmd.HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE)
    assert _connect_as(65534, port, hello) == "closed"
    said = _s_client(tls_port, "host-1", "cd" * 32)  # (times out after 30 s if the server is stuck)
    assert "Cipher is TLS_AES_128_GCM_SHA256" in said, said[-600:]


def test_llama_servers_port_answers_nobody_without_its_key(patched_bins: Binaries, tiny_model: Path,
                                                           tmp_path: Path) -> None:  # fmt: skip
    """Another local user called llama-server's loopback port directly, past `--api-key` and
    `--max-tokens`. llama-server now takes a key of its own (from a 0600 file): `nobody` gets 401 for a completion,
    /slots and /props, and cannot read the key; the API (ours) gets through; /health stays open."""
    from meshllm.llama import supervisor
    from meshllm.serve.http.api import Api
    from meshllm.serve.http.upstream import Upstream

    cfg = supervisor.ServerConfig(model=tiny_model, alias="tiny", ctx_size=512, threads=2)
    server = supervisor.LocalServer(patched_bins, cfg, tmp_path)
    key_file = tmp_path / "llama-server.key"
    assert key_file.stat().st_mode & 0o077 == 0 and key_file.read_text().strip() == server.key
    body = b'{"prompt": "Hello", "n_predict": 4}'
    post = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"

    async def main() -> None:
        server.start()
        api = Api(lambda _m: Upstream("tiny", server.base_url, server.key), lambda: ["tiny"], lambda: {})
        try:
            await server.wait_ready()
            for req in (post % len(body) + body, b"GET /slots HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET /props HTTP/1.1\r\nHost: x\r\n\r\n"):  # fmt: skip
                got = await asyncio.to_thread(_connect_as, 65534, server.port, req)
                assert got == "HTTP/1.1 401 Unauthorized", (req[:20], got)
            health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            said = await asyncio.to_thread(_connect_as, 65534, server.port, health)
            assert said == "HTTP/1.1 200 OK", said
            port = await api.start("127.0.0.1", free_port())
            got = await asyncio.to_thread(_connect_as, None, port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1"
                                          b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            assert got == "HTTP/1.1 200 OK", got
        finally:
            await api.stop()
            await server.stop()

    asyncio.run(main())
