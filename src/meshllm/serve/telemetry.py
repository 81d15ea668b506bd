"""What a node tells the mesh about its llama-server and its API, once a second, through its own gossip record: a
host how far its model has loaded, what its llama-server has done (every completion of the mesh runs there: tokens
generated, prompt tokens, counted across restarts) and its slots; every node how soon its requests got their first
token."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from meshllm.net.meshnet import MeshNet
from meshllm.serve.api import Api
from meshllm.serve.hosting import Hosting


async def watch_llama(net: MeshNet, hosting: Hosting, api: Api | None, hosting_now: Callable[[], bool]) -> None:
    """Forever, once a second; ``hosting_now``: whether this node is the elected host."""
    assert net.core is not None
    base, last, progress, asked = (0, 0), (0, 0), -1, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            await asyncio.sleep(1.0)
            h = api.counters.ttft if api else None
            if h is not None and h.n != asked:  # every node: its requests' time to first token, for the mesh's view
                asked = h.n
                net.update(ttft=(h.n, int(h.total * 1000)))
            server = hosting.server if hosting_now() else None
            p = server.load_progress() if server is not None else -1
            if p != progress:
                progress = p
                net.update(progress=p)
            got = await server.generated(http) if server is not None and p < 0 else None
            if got is not None and got != last:
                if got[0] < last[0] or got[1] < last[1]:  # a new llama-server counts from zero
                    base = (base[0] + last[0], base[1] + last[1])
                last = got
                net.update(served=(base[0] + got[0], base[1] + got[1]))
            slots = hosting.slots_now() if server is not None else (0, 0, 0, 0)
            if slots != net.core.record.slots:  # a host: its slots busy, in all, waiting, and their context
                net.update(slots=slots)
