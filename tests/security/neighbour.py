"""The attacker of the knock-relay attack, as a program of its own (the NAT lab runs it in a namespace of
the LAN, ``test_knock_relay.py`` in a thread): a node with no token that announces the founder's mesh under its own
key (real mDNS), answers every knock "waiting" — or "refused" (``--refuse``) — and relays each knock, as it came, to
the founder; it records the founder's answers and any token one carried.

python -m tests.security.neighbour --mesh HEX --founder HEX --founder-addr IP:PORT --bind IP --out FILE [--refuse]
(runs until SIGTERM or --seconds; FILE gets {"relayed": [[state, reason, token?], ...]} at every answer)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from tempfile import mkdtemp

from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto
from meshllm.proto.knock import REFUSED, WAITING, KnockAnswer, KnockAsk
from meshllm.serve.life.lan import SERVICE


async def neighbour(
    mesh_id: bytes, founder: bytes, founder_addrs: list[str], bind: str, refuse: bool,
    on_answer: Callable[[KnockAnswer], None], stop: threading.Event | asyncio.Event,
) -> None:  # fmt: skip
    """Announce ``mesh_id`` as our own, answer and relay knocks until ``stop`` is set."""
    key = crypto.new_key()
    net = MeshNet(key, None, Path(mkdtemp()), bind=(bind, 0))
    await net.start()
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def on_knock(ask: KnockAsk, addr: str) -> KnockAnswer:
        if refuse:
            return KnockAnswer(REFUSED, reason="this mesh is closed")

        async def relay() -> None:  # to the founder, as it came: the knocking node's own signature
            try:
                on_answer(await net.knock(founder, founder_addrs, ask))
            except Exception:  # the attack goes on whatever fails
                return

        tasks.add(loop.create_task(relay()))
        return KnockAnswer(WAITING)

    net.on_knock = on_knock
    short = crypto.short(net.me)
    info = AsyncServiceInfo(
        SERVICE, f"{short}.{SERVICE}", port=net.ep.local_addr[1], addresses=[socket.inet_aton(bind)],
        server=f"mesh-llm-{short}.local.",
        properties={"v": "1", "mesh": mesh_id.hex(), "node": net.me.hex(), "name": "neighbour"},
    )  # fmt: skip
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    await zc.async_register_service(info)
    try:
        while not stop.is_set():
            await asyncio.sleep(0.1)
    finally:
        await zc.async_unregister_service(info)
        await zc.async_close()
        await net.stop(leave=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--founder", required=True)
    ap.add_argument("--founder-addr", action="append", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--refuse", action="store_true")
    ap.add_argument("--seconds", type=float, default=300.0)
    args = ap.parse_args()
    got: list[list[str]] = []

    def on_answer(ans: KnockAnswer) -> None:
        got.append([ans.state, ans.reason, ans.token])
        args.out.write_text(json.dumps({"relayed": got}))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.call_later(args.seconds, stop.set)
        args.out.write_text(json.dumps({"relayed": got, "up": True}))
        await neighbour(bytes.fromhex(args.mesh), bytes.fromhex(args.founder), args.founder_addr, args.bind,
                        args.refuse, on_answer, stop)  # fmt: skip

    asyncio.run(run())


if __name__ == "__main__":
    main()
