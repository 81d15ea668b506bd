"""Workers load weights from their own GGUF, proven to be the same file.

Real binaries, the real test model, two rpc-servers each behind a counting relay, llama-server --rpc to both.
"""

from __future__ import annotations

import re
import shutil
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshllm.llama.build import Binaries
from meshllm.llama.gguf import model_fingerprint, read_header
from meshllm.llama.processes import Child, free_port, rpc_server_argv, wait_tcp_ready
from meshllm.llama.rpcwire import (
    CONN_CAPS_SIZE,
    GGUF_CAPS_MAGIC,
    HEADER,
    Cmd,
    CountingRelay,
    WireStats,
    pack_rpc_tensor,
)
from tests.gguf_files import altered_copy

from .splitlab import Split, Worker, start_split, stop_split

MB = 1_000_000


@pytest.fixture(scope="module")
def module_children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for c in reversed(started):
        c.stop()


@pytest.fixture(scope="module")
def module_relays() -> Iterator[list[CountingRelay]]:
    relays: list[CountingRelay] = []
    yield relays
    for r in relays:
        r.close()


@pytest.fixture(scope="module")
def reference(
    stock_bins: Binaries,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    module_children: list[Child],
    module_relays: list[CountingRelay],
) -> tuple[str, list[WireStats], int]:
    """The same split loaded the stock way: stock llama-server, two stock rpc-servers. (text, load stats, rchar)"""
    tmp = tmp_path_factory.mktemp("stock-split")
    s = start_split(
        tmp, stock_bins, [Worker(stock_bins), Worker(stock_bins)], tiny_model, module_children, module_relays
    )
    try:
        return s.complete(), s.load, s.rchar()
    finally:
        stop_split(s)


@pytest.fixture(scope="module")
def altered_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model with other weights (tests/gguf_files.py)."""
    return altered_copy(tiny_model, tmp_path_factory.mktemp("altered") / "gemma-3-270m-altered.gguf")


def _weights_pushed(stats: WireStats) -> int:
    return stats.payload[Cmd.SET_TENSOR] + stats.payload[Cmd.SET_TENSOR_HASH]


def _rpc_fingerprint(bins: Binaries, model: Path, tmp: Path, children: list[Child], vouched: str | None = None) -> str:
    """The fingerprint the server presents (the last it prints: with ``vouched``, the one it was given)."""
    port = free_port()
    child = Child.start("rpc-fp", rpc_server_argv(bins, port, threads=1, gguf=model, vouched=vouched),
                        tmp / f"fp-{model.name}-{vouched is not None}.log")  # fmt: skip
    children.append(child)
    wait_tcp_ready(child, port)
    m = re.findall(r"fingerprint\s*:\s*([0-9a-f]{64})", child.log_path.read_text())
    assert m, child.log_tail()
    child.stop()
    return str(m[-1])


def test_python_fingerprint_matches_the_binary(
    patched_bins: Binaries, tiny_model: Path, altered_model: Path, tmp_path: Path, children: list[Child]
) -> None:
    fp = model_fingerprint(tiny_model)
    assert _rpc_fingerprint(patched_bins, tiny_model, tmp_path, children) == fp
    other = model_fingerprint(altered_model)
    assert other != fp, "a file differing only in one tensor's data must have another fingerprint"
    assert _rpc_fingerprint(patched_bins, altered_model, tmp_path, children) == other
    # patch 0010: a partial copy's server presents the fingerprint it is given (checked by mesh-llm); a malformed one
    # stops it at once
    import subprocess

    from meshllm.llama.processes import rpc_server_argv

    assert _rpc_fingerprint(patched_bins, altered_model, tmp_path, children, vouched=fp) == fp
    argv = rpc_server_argv(patched_bins, 1, gguf=altered_model, vouched=fp)
    assert argv[-2:] == ["--gguf-fingerprint", fp]
    bad = subprocess.run([*argv[:-1], fp.upper()], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--gguf-fingerprint: not lower-case hex" in bad.stderr, bad.stderr
    short = subprocess.run([*argv[:-1], fp[:-1]], capture_output=True, text=True, timeout=60)
    assert short.returncode == 1 and "needs --gguf and 64 hex digits" in short.stderr, short.stderr


def test_local_load_sends_no_weights_and_gives_the_stock_text(
    patched_bins: Binaries,
    tiny_model: Path,
    reference: tuple[str, list[WireStats], int],
    tmp_path: Path,
    children: list[Child],
) -> None:
    ref_text, ref_load, ref_rchar = reference
    relays: list[CountingRelay] = []
    s = start_split(
        tmp_path,
        patched_bins,
        [Worker(patched_bins, tiny_model), Worker(patched_bins, tiny_model)],
        tiny_model,
        children,
        relays,
    )
    try:
        pushed = sum(_weights_pushed(x) for x in s.load)
        assert pushed <= 1 * MB, f"{pushed} bytes of weights pushed"
        assert sum(_weights_pushed(x) for x in ref_load) > 200 * MB  # the stock way pushes them all
        for i, (mine, stock) in enumerate(zip(s.load, ref_load, strict=True)):
            assert mine.commands[Cmd.SET_TENSOR_GGUF] > 0, f"worker {i} loaded nothing from its file"
            assert mine.commands[Cmd.GGUF_STATUS] >= 1
            assert mine.round_trips <= stock.round_trips, (i, mine.round_trips, stock.round_trips)
            assert mine.connections <= stock.connections
        # The host reads its own tensors (the 170 MiB token embedding stays on the CPU), not the workers'.
        # On top: llama.cpp parses the 6.5 MB header three times and the fingerprint reads it twice more plus
        # its sampled windows (~40 MB measured with strace); the budget allows that, not a worker's tensors.
        hdr = read_header(tiny_model)
        embd = next(t.nbytes for t in hdr.tensors if t.name == "token_embd.weight")
        rchar = s.rchar()
        assert rchar <= embd + 6 * hdr.data_offset + 16 * 2**20, (rchar, embd)
        assert ref_rchar > tiny_model.stat().st_size  # stock reads every byte (and the tied output twice)
        assert s.complete() == ref_text
    finally:
        stop_split(s)
        for r in relays:
            r.close()


@pytest.mark.parametrize("second", ["no-gguf", "other-file"])
def test_worker_without_the_same_file_is_pushed_instead(
    second: str,
    patched_bins: Binaries,
    tiny_model: Path,
    altered_model: Path,
    reference: tuple[str, list[WireStats], int],
    tmp_path: Path,
    children: list[Child],
) -> None:
    w1 = Worker(patched_bins, None if second == "no-gguf" else altered_model)
    relays: list[CountingRelay] = []
    s = start_split(tmp_path, patched_bins, [Worker(patched_bins, tiny_model), w1], tiny_model, children, relays)
    try:
        assert _weights_pushed(s.load[0]) <= 1 * MB
        assert s.load[1].commands[Cmd.SET_TENSOR_GGUF] == 0
        assert _weights_pushed(s.load[1]) > 20 * MB
        assert s.complete() == reference[0]
    finally:
        stop_split(s)
        for r in relays:
            r.close()


def _partial_copy(model: Path, out: Path, tensor: str) -> tuple[int, int]:
    """``model`` as a worker that fetched only some tensors would hold it: the same bytes everywhere but a hole
    (unwritten blocks, read back as zeros) across part of ``tensor``, clear of the 4 KiB windows the model
    fingerprint samples. The hole's (offset, length)."""
    hdr = read_header(model)
    t = next(x for x in hdr.tensors if x.name == tensor)
    step = (t.nbytes - 4096) // 15
    lo = -(-(t.offset + step + 4096) // 4096) * 4096  # past window 1, block-aligned
    hi = (t.offset + 2 * step) // 4096 * 4096  # before window 2
    assert hi - lo >= 16 * 1024, (lo, hi)
    with model.open("rb") as src, out.open("wb") as dst:
        dst.write(src.read(lo))
        src.seek(hi)
        dst.seek(hi)  # past the end: the blocks between are never written
        shutil.copyfileobj(src, dst)
    return lo, hi - lo


def test_a_partial_file_loads_what_it_holds_and_the_host_pushes_the_rest(
    patched_bins: Binaries,
    tiny_model: Path,
    reference: tuple[str, list[WireStats], int],
    tmp_path: Path,
    children: list[Child],
) -> None:
    """A worker whose copy has holes (it fetched only its layers) has the model's fingerprint, so the host
    asks it to load its tensors from its file; a tensor that lies in a hole must fail to load there (patch 0009)
    and be pushed, or the worker computes with zeros."""
    import os

    part = tmp_path / "partial.gguf"
    lo, n = _partial_copy(tiny_model, part, "blk.1.ffn_up.weight")  # a tensor of the first worker's layers
    with part.open("rb") as f:
        assert os.lseek(f.fileno(), lo, os.SEEK_HOLE) == lo, "this filesystem made no hole"
    assert model_fingerprint(part) == model_fingerprint(tiny_model)
    relays: list[CountingRelay] = []
    s = start_split(tmp_path, patched_bins, [Worker(patched_bins, part), Worker(patched_bins, tiny_model)],
                    tiny_model, children, relays)  # fmt: skip
    try:
        assert s.load[0].commands[Cmd.SET_TENSOR_GGUF] > 0  # it was asked to load from its file
        # the load that met the hole failed, so the host pushed (patch 0003 pushes that buffer's tensors again)
        assert _weights_pushed(s.load[0]) >= n, _weights_pushed(s.load[0])
        assert "a hole: a partial copy" in s.workers[0].log_path.read_text()
        assert _weights_pushed(s.load[1]) <= 1 * MB
        assert s.complete() == reference[0]
    finally:
        stop_split(s)
        for r in relays:
            r.close()


@pytest.mark.parametrize("direction", ["stock-client", "stock-servers"])
def test_stock_and_patched_interoperate(
    direction: str,
    patched_bins: Binaries,
    stock_bins: Binaries,
    tiny_model: Path,
    reference: tuple[str, list[WireStats], int],
    tmp_path: Path,
    children: list[Child],
) -> None:
    if direction == "stock-client":
        client, workers = stock_bins, [Worker(patched_bins, tiny_model), Worker(patched_bins, tiny_model)]
    else:
        client, workers = patched_bins, [Worker(stock_bins), Worker(stock_bins)]
    relays: list[CountingRelay] = []
    s: Split = start_split(tmp_path, client, workers, tiny_model, children, relays)
    try:
        for st in s.load:
            assert st.commands[Cmd.SET_TENSOR_GGUF] == 0 and st.commands[Cmd.GGUF_STATUS] == 0
        assert sum(_weights_pushed(x) for x in s.load) > 200 * MB
        assert s.complete() == reference[0]
    finally:
        stop_split(s)
        for r in relays:
            r.close()


# ------------------------------------------------------------------------------------------ on the wire


class RpcClient:
    """A hand-driven RPC client for malformed requests."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, cmd: int, payload: bytes, size: int | None = None) -> None:
        self.sock.sendall(HEADER.pack(cmd, len(payload) if size is None else size) + payload)

    def recv_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def call(self, cmd: int, payload: bytes) -> bytes:
        self.send(cmd, payload)
        (size,) = struct.unpack("<Q", self.recv_exact(8))
        return self.recv_exact(size)

    def hello(self, ask_gguf: bool = True) -> bytes:
        caps = (GGUF_CAPS_MAGIC + b"\x01").ljust(CONN_CAPS_SIZE, b"\0") if ask_gguf else bytes(CONN_CAPS_SIZE)
        rsp = self.call(Cmd.HELLO, caps)
        assert rsp[:3] == bytes([7, 0, 0])
        return rsp[4:]

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def test_malformed_local_loads_fail_cleanly_and_the_server_goes_on(
    patched_bins: Binaries, tiny_model: Path, tmp_path: Path, children: list[Child]
) -> None:
    port = free_port()
    srv = Child.start("rpc", rpc_server_argv(patched_bins, port, threads=1, gguf=tiny_model), tmp_path / "rpc.log")
    children.append(srv)
    wait_tcp_ready(srv, port)
    hdr = read_header(tiny_model)
    norm = next(t for t in hdr.tensors if t.name == "output_norm.weight")
    assert norm.ggml_type == 0 and norm.shape == (640,) and norm.nbytes == 2560
    file_bytes = tiny_model.read_bytes()[norm.offset : norm.offset + norm.nbytes]

    c = RpcClient(port)
    caps = c.hello()
    assert caps[:6] == GGUF_CAPS_MAGIC and caps[7] & 1
    assert caps[8:24] == bytes.fromhex(model_fingerprint(tiny_model))[:16]
    buf_size = 1 << 20
    remote, _size = struct.unpack("<QQ", c.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, buf_size)))
    (base,) = struct.unpack("<Q", c.call(Cmd.BUFFER_GET_BASE, struct.pack("<Q", remote)))
    c.send(Cmd.BUFFER_CLEAR, struct.pack("<QB", remote, 0))

    def load(
        *,
        name: bytes = b"output_norm.weight",
        ggml_type: int = 0,
        ne0: int = 640,
        buffer: int = remote,
        data: int = base,
        offset: int = 0,
        size: int = 2560,
    ) -> None:
        t = pack_rpc_tensor(
            ggml_type=ggml_type, buffer=buffer, ne=(ne0, 1, 1, 1), nb=(4, ne0 * 4, ne0 * 4, ne0 * 4), data=data,
            name=name,
        )  # fmt: skip
        c.send(Cmd.SET_TENSOR_GGUF, t + struct.pack("<QQ", offset, size))

    def status(buffer: int = remote) -> tuple[int, int, int]:
        n_ok, n_failed, nbytes = struct.unpack("<QQQ", c.call(Cmd.GGUF_STATUS, struct.pack("<Q", buffer)))
        return n_ok, n_failed, nbytes

    def read_back(offset: int, size: int) -> bytes:
        t = pack_rpc_tensor(
            ggml_type=0, buffer=remote, ne=(size // 4, 1, 1, 1), nb=(4, size, size, size), data=base + offset,
            name=b"x",
        )  # fmt: skip
        return c.call(Cmd.GET_TENSOR, t + struct.pack("<QQ", 0, size))

    load(data=base + 4096)  # a valid load, placed 4 KiB into the buffer
    assert status() == (1, 0, 2560)
    assert read_back(4096, 2560) == file_bytes

    bad: list[dict[str, object]] = [
        {"name": b"A" * 64},  # no terminating NUL
        {"name": b"no.such.tensor"},
        {"offset": 2560, "size": 1},  # past the tensor's end
        {"offset": 0, "size": 2561},
        {"offset": 2**63, "size": 2**63},  # wraps around
        {"ggml_type": 1},  # f16, file says f32
        {"ne0": 641},  # shape differs
        {"data": base + buf_size - 100},  # tensor would run past its buffer
        {"data": base - 4096},  # before its buffer
    ]
    for kw in bad:
        load(**{"data": base + 8192, **kw})  # type: ignore[arg-type]
    assert status() == (0, len(bad), 0)
    load(buffer=0xDEADBEEF)  # a buffer this connection never allocated: counted apart, touches nothing
    assert status(0) == (0, 1, 0)
    assert read_back(8192, 4096) == bytes(4096), "a refused load wrote into the buffer"
    assert read_back(buf_size - 4096, 4096) == bytes(4096)

    # a frame whose size field does not match the command: the server drops this client ...
    c.send(Cmd.SET_TENSOR_GGUF, b"", size=2**40)
    assert c.closed()
    c.close()
    # ... and serves the next one
    c2 = RpcClient(port)
    assert c2.hello()[:6] == GGUF_CAPS_MAGIC
    # a stock-style HELLO (no marker) gets stock, all-zero caps
    c3 = RpcClient(port)
    c2.close()
    assert c3.hello(ask_gguf=False) == bytes(CONN_CAPS_SIZE)
    c3.close()
    assert srv.alive()
