"""A TCP relay on loopback that delays every byte by a fixed time each way: a LAN's round trip between two processes
of one machine, where netem is not to be had (the lent GPU machine's kernel has no sch_netem).

Each direction has a reader thread, which stamps what it reads, and a writer thread, which sends it when its stamp is
``delay`` old: bytes in flight overlap (a pipe, not a stop-and-wait), and the rate is what loopback and Python give
(hundreds of MB/s: more than a 1 Gbit/s LAN). time.sleep's precision (~0.1 ms) bounds the delay's."""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayRelay:
    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target_port))
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(a, b)
            self._pipe(b, a)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        q: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                q.put((time.monotonic() + self.delay_s, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    with _quiet():
                        dst.shutdown(socket.SHUT_WR)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self.sock.close()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True
