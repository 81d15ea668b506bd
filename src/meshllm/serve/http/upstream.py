"""Where a request goes: an upstream (our own llama-server with its slots, or a tunnel to the node that serves the
model, with what the mesh knows of it), why there is none yet (``Unavailable``), and an upstream's answer read as it
comes — cut short once it has been quiet a while and its node has gone silent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from meshllm.proto.fleet import Spread
from meshllm.serve.http.slotgate import SlotGate

QUIET_S = 1.0  # an answer that brings nothing for this long asks whether its host is still alive (``Upstream.alive``)


@dataclass(frozen=True)
class Upstream:
    """Where a model is served: an HTTP base URL reachable from this process (a local port or a tunnel)."""

    model: str
    base_url: str
    key: str | None = None  # llama-server's own key (a local one); None: the upstream takes none (a host's door)
    slots: SlotGate | None = None  # our own llama-server's slots: completions wait there for one (None: another node's)
    node: bytes = b""  # the node that serves it (a replica or the elected host: ``spread`` counts its requests)
    spread: Spread | None = None
    alive: Callable[[], bool] | None = None  # another node's: whether the mesh still hears from it
    stops: tuple[str, ...] = ()  # our own llama-server's: stop strings every chat to it gets (a base model's turns)
    embedding: bool | None = None  # our own: whether it is an embedding model (None: another node's: its door knows)


async def chunks(r: aiohttp.ClientResponse, up: Upstream) -> AsyncIterator[bytes]:
    """The response's bytes as they come; ConnectionError once it has been quiet QUIET_S and the node serving it
    has gone silent (killed: its tunnel would say so only when the mesh declares it dead, seconds later)."""
    while True:
        try:
            chunk = await (asyncio.wait_for(r.content.readany(), QUIET_S) if up.alive else r.content.readany())
        except TimeoutError:
            if up.alive is not None and not up.alive():
                raise ConnectionError("the node serving it went silent") from None
            continue
        if not chunk:
            return
        yield chunk


@dataclass(frozen=True)
class Unavailable:
    reason: str
    retry_after_s: int = 5
