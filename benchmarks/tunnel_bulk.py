"""The QUIC tunnel's own costs, on loopback, next to plain TCP: round-trip time of small messages and bulk
throughput, through the real pieces (two processes, each with its own Endpoint; TunnelListener on one side,
connect_and_bridge to a local TCP service on the other — what a host and a worker run for RPC).

    .venv/bin/python benchmarks/tunnel_bulk.py [--mb 200] [--pings 2000]

The service behind the tunnel is a TCP echo (for the ping) and a sink that answers the byte count (for bulk).
Prints one table: p50/p99 round trip of a 64-byte message, and MB/s of one --mb MB stream, for the tunnel and
for the same service over plain loopback TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import header  # benchmarks/common.py: the command line and machine

from meshllm.net.conn import STREAM_RPC, Conn, Stream
from meshllm.net.endpoint import Endpoint
from meshllm.net.tunnel import TunnelListener, TunnelStats, connect_and_bridge
from meshllm.proto import crypto


def service(port_q: mp.Queue) -> None:  # type: ignore[type-arg]
    """TCP on loopback: 'P' + 64 bytes -> echo; 'B' + u64 n + n bytes -> u64 n."""

    async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                op = await r.readexactly(1)
                if op == b"P":
                    w.write(await r.readexactly(64))
                else:
                    (n,) = struct.unpack("<Q", await r.readexactly(8))
                    left = n
                    while left:
                        left -= len(await r.read(min(left, 1 << 20)))
                    w.write(struct.pack("<Q", n))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    async def main() -> None:
        srv = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        await srv.serve_forever()

    asyncio.run(main())


def far_end(svc_port: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """The worker's side: an Endpoint that bridges every RPC stream to the service."""

    async def main() -> None:
        tasks: set[asyncio.Future[None]] = set()

        async def on_accept(conn: Conn) -> None:
            conn.set_authenticated()
            while (st := await conn.accept()) is not None:
                if st.kind == STREAM_RPC:
                    tasks.add(asyncio.ensure_future(connect_and_bridge(st, svc_port, TunnelStats())))

        ep = Endpoint(crypto.new_key(), on_accept=on_accept)
        addr = await ep.open("127.0.0.1", 0)
        q.put((addr, ep.me))
        await asyncio.Event().wait()

    asyncio.run(main())


def near_end(q: mp.Queue, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """The host's side: an Endpoint dialled to the far end and a TunnelListener; reports its port."""

    async def main() -> None:
        addr, me = q.get()
        ep = Endpoint(crypto.new_key())
        await ep.open("127.0.0.1", 0)
        conn = await ep.dial(addr, me)

        def open_stream() -> Stream | None:
            return conn.open_stream(STREAM_RPC)

        lst = TunnelListener(open_stream, TunnelStats())
        out.put(await lst.start())
        await asyncio.Event().wait()

    asyncio.run(main())


def measure(port: int, pings: int, mb: int) -> tuple[float, float, float]:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            assert chunk, "closed"
            buf += chunk
        return buf

    rtts = []
    msg = bytes(range(64))
    for i in range(pings + 50):
        t0 = time.perf_counter()
        s.sendall(b"P" + msg)
        assert exact(64) == msg
        if i >= 50:  # warm-up
            rtts.append((time.perf_counter() - t0) * 1e3)
    n = mb << 20
    block = bytes(1 << 20)
    t0 = time.perf_counter()
    s.sendall(b"B" + struct.pack("<Q", n))
    for _ in range(mb):
        s.sendall(block)
    assert struct.unpack("<Q", exact(8))[0] == n
    secs = time.perf_counter() - t0
    s.close()
    q = statistics.quantiles(rtts, n=100)
    return statistics.median(rtts), q[98], mb * 1.048576 / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--pings", type=int, default=2000)
    args = ap.parse_args()
    header()
    ctx = mp.get_context("spawn")
    pq, q, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=service, args=(pq,), daemon=True)]
    procs[0].start()
    svc = pq.get(timeout=30)
    procs += [
        ctx.Process(target=far_end, args=(svc, q), daemon=True),
        ctx.Process(target=near_end, args=(q, out), daemon=True),
    ]
    for p in procs[1:]:
        p.start()
    tun = out.get(timeout=60)
    rows = {"plain TCP (loopback)": measure(svc, args.pings, args.mb), "QUIC tunnel": measure(tun, args.pings, args.mb)}
    for p in procs:
        p.kill()
    print(f"{args.pings} pings of 64 B, one stream of {args.mb} MB; this machine ({mp.cpu_count()} cores)\n")
    print("| path | RTT p50 ms | RTT p99 ms | bulk MB/s |\n|---|---:|---:|---:|")
    for name, (p50, p99, mbs) in rows.items():
        print(f"| {name} | {p50:.3f} | {p99:.3f} | {mbs:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
