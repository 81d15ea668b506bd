"""[trust] Other users of the same machine: the host's loopback tunnel listeners (llama-server's way to the workers'
rpc-servers) take clients of our own user only. Acting as another user needs root (CI runs as root)."""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401  (loaded before the fork: the child, as nobody, may not read the stdlib)
import os
import socket

import pytest

from meshllm.net.tunnel import TunnelListener, TunnelStats

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user (nobody) needs root")

def _connect_as(uid: int | None, port: int) -> str:
    """In a forked child (running as ``uid`` if given): connect, send an RPC HELLO, say whether anything came back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no asyncio, no exec (another user may not read our virtualenv)
        try:
            os.close(r)
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"\x0e" + bytes(8))
            s.settimeout(10)
            try:
                got = b"closed" if s.recv(1) == b"" else b"answered"
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
