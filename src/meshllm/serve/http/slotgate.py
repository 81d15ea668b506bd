"""The asyncio shell of ``proto/slots.py``: requests for the host's llama-server wait here for a slot.

One SlotGate per host, shared by its own API and by the door its peers' requests come through. ``hold`` is an async
context: it returns once the request has its slots, or raises :class:`QueueFull` (the API answers 429); leaving it —
answered, failed, or cancelled because the client went away — frees them for the next request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from meshllm.proto import slots as core


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"every slot is busy and the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class SlotGate:
    def __init__(self, total: int, queue_max: int | None = None) -> None:
        self.fixed_queue = queue_max  # --queue; None: core.default_queue of the slots
        self.core = core.Slots(total, queue_max if queue_max is not None else core.default_queue(total))
        self._waiters: dict[int, asyncio.Future[bool]] = {}

    def resize(self, total: int) -> None:
        q = self.fixed_queue if self.fixed_queue is not None else core.default_queue(total)
        self._wake(self.core.resize(total, q, time.monotonic()))

    def _wake(self, admitted: list[core.Ticket]) -> None:
        for t in admitted:
            fut = self._waiters.pop(t.id, None)
            if fut is not None and not fut.done():
                fut.set_result(True)

    @contextlib.asynccontextmanager
    async def hold(self, source: str, weight: int = 1) -> AsyncIterator[None]:
        got = self.core.arrive(source, weight, time.monotonic())
        if isinstance(got, core.Refused):
            raise QueueFull(got.retry_after_s)
        ticket = got.ticket
        if isinstance(got, core.Queued):
            if got.displaced is not None:
                pushed = self._waiters.pop(got.displaced.id, None)
                if pushed is not None and not pushed.done():
                    pushed.set_result(False)
            fut = asyncio.get_running_loop().create_future()
            self._waiters[ticket.id] = fut
            try:
                admitted = await fut
            except BaseException:  # the client went away while it waited
                self._waiters.pop(ticket.id, None)
                self._wake(self.core.leave(ticket.id, time.monotonic()))  # waiting or just admitted: out either way
                raise
            if not admitted:
                raise QueueFull(self.core.retry_after())
        try:
            yield
        finally:
            self._wake(self.core.leave(ticket.id, time.monotonic()))

    def snapshot(self) -> tuple[int, int, int]:
        """(slots busy, slots in all, requests waiting)."""
        return self.core.busy, self.core.total, self.core.queued
