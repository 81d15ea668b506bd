"""The direct path's guards, on real loopback sockets: only a ticket the source issued over the mesh opens it,
a ticket ends, and the fetcher talks only to the certificate the member named."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest

from meshllm.serve.fetch import direct as fd

PEER = b"\x05" * 32


async def _source(tmp: Path) -> tuple[fd.DirectSource, list[tuple[bytes, str, int]]]:
    asked: list[tuple[bytes, str, int]] = []

    async def chunk(peer: bytes, fp: str, index: int) -> bytes | None:
        asked.append((peer, fp, index))
        return b"x" * 1000 if fp == "fp" else None

    src = fd.DirectSource(tmp, "127.0.0.1", chunk)
    await src.start()
    return src, asked


def test_a_ticket_opens_the_direct_path_for_its_holder_only(tmp_path: Path) -> None:
    async def run() -> None:
        src, asked = await _source(tmp_path)
        try:
            t = src.ticket(PEER, time.monotonic())
            link = await fd.DirectLink.open("127.0.0.1", t)
            assert link is not None
            assert await link.get("fp", 3, 4096, 5) == b"x" * 1000
            assert asked == [(PEER, "fp", 3)]  # served as the ticket's holder
            assert await link.get("other", 0, 4096, 5) is None  # refused: the link is closed
            # a made-up ticket: the source reads 32 bytes and closes; nothing is asked
            forged = msgpack.packb({**msgpack.unpackb(t), "ticket": b"\x00" * fd.TICKET_LEN})
            bad = await fd.DirectLink.open("127.0.0.1", forged)
            assert bad is not None and await bad.get("fp", 1, 4096, 5) is None and len(asked) == 2
            # another certificate than the one the member named over the mesh: not used
            other = msgpack.packb({**msgpack.unpackb(t), "cert": "0" * 64})
            assert await fd.DirectLink.open("127.0.0.1", other) is None
            # an ended ticket opens nothing
            old = src.ticket(PEER, time.monotonic() - fd.TICKET_S - 1)
            late = await fd.DirectLink.open("127.0.0.1", old)
            assert late is not None and await late.get("fp", 2, 4096, 5) is None and len(asked) == 2
            assert (tmp_path / "fetch-tls" / "key.pem").stat().st_mode & 0o077 == 0
        finally:
            await src.stop()

    asyncio.run(run())


@pytest.mark.parametrize("raw", [b"", b"\x80", msgpack.packb({"port": 0, "cert": "", "ticket": b""}),
                                 msgpack.packb([1, 2, 3])])  # fmt: skip
def test_a_malformed_ticket_is_no_link(raw: bytes) -> None:
    assert asyncio.run(fd.DirectLink.open("127.0.0.1", raw)) is None


def test_a_member_sends_only_its_own_file_and_nothing_with_share_off(tmp_path: Path) -> None:
    """What both paths serve goes through ``Sharing.chunk``: only the model file this node serves, by fingerprint,
    only chunks that exist, and nothing at all with ``--share off``."""
    from meshllm.proto import crypto
    from meshllm.serve.fetch.sharing import Sharing
    from tests.gguf_files import write_gguf

    model = write_gguf(tmp_path / "m.gguf", layers=1)
    data = model.read_bytes()

    async def run(share: bool) -> list[bytes | None]:
        s = Sharing(crypto.new_key(), tmp_path, lambda: {"fp": model}, share)
        return [await s.chunk(PEER, "fp", 0), await s.chunk(PEER, "other", 0), await s.chunk(PEER, "fp", 99),
                await s.chunk(PEER, "fp", True), await s.chunk(PEER, "fp", -1)]  # fmt: skip

    head, *_ = asyncio.run(run(True))
    assert asyncio.run(run(True)) == [data[: len(head or b"")], None, None, None, None] and head
    assert asyncio.run(run(False)) == [None] * 5
