"""What a node tells the mesh about its llama-server and its API, once a second, through its own gossip record: a
host how far its model has loaded, what its llama-server has done (every completion of the mesh runs there: tokens
generated (running requests' tokens included), prompt tokens, counted across restarts, the rate now, a crash's
reason) and its slots; every node how soon its requests got their first
token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from meshllm.llama.supervisor import ChildState
from meshllm.net.meshnet import MeshNet
from meshllm.proto.record import MAX_WHY
from meshllm.proto.standing import FAILED_PREFIX, RateMeter
from meshllm.serve.http.api import Api
from meshllm.serve.split.hosting import Hosting


async def watch_llama(net: MeshNet, hosting: Hosting, api: Api | None, hosting_now: Callable[[], bool]) -> None:
    """Forever, once a second; ``hosting_now``: whether this node runs llama-server for its plan (the elected host,
    or a replica)."""
    assert net.core is not None
    base, last, sent, progress, asked = (0, 0), (0, 0), (0, 0), -1, 0
    meter = RateMeter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            await asyncio.sleep(1.0)
            h = api.counters.ttft if api else None
            if h is not None and h.n != asked:  # every node: its requests' time to first token, for the mesh's view
                asked = h.n
                net.update(ttft=(h.n, int(h.total * 1000)))
            server = hosting.server if hosting_now() else None
            # a crash's reason, or none: while llama-server restarts, its last run's "100%" is no progress
            why = server.reason if server is not None else None
            if server is not None and server.state == ChildState.FAILED:
                why = FAILED_PREFIX + server.reason
            p = server.load_progress() if server is not None and not why else -1
            if p != progress:
                progress = p
                net.update(progress=p)
            if why is not None and why[:MAX_WHY] != net.core.record.why:
                net.update(why=why[:MAX_WHY])
            got = await server.generated(http) if server is not None and p < 0 else None
            if got is not None:
                done, prompt, running = got
                if done < last[0] or prompt < last[1]:  # a new llama-server counts from zero
                    base = (base[0] + last[0], base[1] + last[1])
                last = (done, prompt)
                # never down (peers sum it up: ``standing.Tally``), running requests' tokens included
                now_ = (max(sent[0], base[0] + done + running), max(sent[1], base[1] + prompt))
                if now_ != sent:
                    sent = now_
                    net.update(served=sent)
                rate = round(meter.add(time.monotonic(), sent[0]), 1)
                if rate != net.core.record.rate:
                    net.update(rate=rate)
            slots = hosting.slots_now() if server is not None else (0, 0, 0, 0)
            if slots != net.core.record.slots:  # a host: its slots busy, in all, waiting, and their context
                net.update(slots=slots)
