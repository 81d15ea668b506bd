"""A TCP relay that delays every byte by a fixed time each way (and caps the rate, if asked): a link's round trip
between processes of one machine, where the kernel has no netem. For benchmarks: ``MESH_LLM_NETEM`` puts one in
front of a worker's direct-path and peer listeners (``llama/supervisor.RpcServer``, from ``serve/split/hosting``), and
the benchmarks put them in front of plain rpc-servers (``benchmarks/latency.py``, ``gpu_split.py --rtt-ms``). A leaf
beside ``sockets``: the llama.cpp shells may use it, the network layer's netem does not need it.

Each direction has a reader thread, which stamps what it reads, and a writer thread, which sends it when its stamp
is due: bytes in flight overlap (a pipe, not a stop-and-wait). time.sleep's precision (~0.1 ms) bounds the delay's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque

from meshllm.sockets import bound


class DelayProxy:
    """A TCP relay listening on ``host``:``port`` (port 0: any free one; ``self.port`` says which) in front of
    127.0.0.1:``upstream_port``: each direction's bytes leave rtt/2 ms after they arrived, no faster than rate MB/s
    (0: no cap). A client that comes while the upstream is down is closed; the relay goes on."""

    def __init__(self, upstream_port: int, rtt_ms: float, rate_mb_s: float = 0.0, host: str = "127.0.0.1",
                 port: int = 0) -> None:  # fmt: skip
        self.upstream = ("127.0.0.1", upstream_port)
        self.delay = rtt_ms / 2000.0
        self.rate = rate_mb_s * 1e6
        self._ls = bound(host, port, socket.SOCK_STREAM)
        self._ls.listen(16)
        self.port: int = self._ls.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"delay:{self.port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._ls.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.upstream, timeout=5)
                u.settimeout(None)
            except OSError:
                c.close()
                continue
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [c, u]
            for a, b in ((c, u), (u, c)):
                self._pipe(a, b)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        q: deque[tuple[float, bytes]] = deque()
        cv = threading.Condition()

        def reader() -> None:
            free_at = 0.0
            while True:
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                now = time.monotonic()
                if self.rate > 0 and data:
                    free_at = max(now, free_at) + len(data) / self.rate
                    now = free_at
                with cv:
                    q.append((now + self.delay, data))
                    cv.notify()
                if not data:
                    return

        def writer() -> None:
            while True:
                with cv:
                    while not q:
                        cv.wait()
                    t, data = q.popleft()
                wait = t - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:  # pass the half-close on (close() would not wake the other direction's recv)
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._ls.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not, on Linux)
        self._ls.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
