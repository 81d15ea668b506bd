"""Fuzzing the C++ we added to llama.cpp: the patched rpc-server's own commands (SET_TENSOR_GGUF, GGUF_STATUS
and the capabilities in HELLO), driven by hypothesis against the real binary with the real tiny model.

Each example is one command with arbitrary fields (tensor name bytes, type, shape, strides, data pointer inside,
around or far from a real buffer, file offset and size, buffer ids). Whatever the input, the server must stay up,
keep serving this connection, touch nothing outside what a valid load may write, and still load a valid tensor
afterwards. Stock llama.cpp's own commands are upstream's to harden (a crash there is not a bug of ours to fix in
this suite); the hand-picked malformed loads live in tests/integration/test_local_gguf.py.
"""

from __future__ import annotations

import struct
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.llama.build import Binaries
from meshllm.llama.gguf import read_header
from meshllm.llama.processes import Child, free_port, rpc_server_argv, wait_tcp_ready
from meshllm.llama.rpcwire import CONN_CAPS_SIZE, GGUF_CAPS_MAGIC, HELLO_REPLY_SIZE, Cmd, pack_rpc_tensor
from tests.integration.test_local_gguf import RpcClient

BUF = 1 << 20
U64 = st.integers(0, 2**64 - 1)


def _connect(port: int) -> tuple[RpcClient, int, int]:
    """A client past HELLO (asking for local loads) with a cleared 1 MiB buffer: (client, buffer id, base)."""
    c = RpcClient(port)
    assert c.hello()[:6] == GGUF_CAPS_MAGIC
    remote, _ = struct.unpack("<QQ", c.call(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, BUF)))
    (base,) = struct.unpack("<Q", c.call(Cmd.BUFFER_GET_BASE, struct.pack("<Q", remote)))
    c.send(Cmd.BUFFER_CLEAR, struct.pack("<QB", remote, 0))
    return c, remote, base


def test_the_patched_rpc_commands_survive_arbitrary_fields(
    patched_bins: Binaries, tiny_model: Path, tmp_path: Path, children: list[Child]
) -> None:
    port = free_port()
    srv = Child.start("rpc", rpc_server_argv(patched_bins, port, threads=1, gguf=tiny_model), tmp_path / "rpc.log")
    children.append(srv)
    wait_tcp_ready(srv, port)
    norm = next(t for t in read_header(tiny_model).tensors if t.name == "output_norm.weight")
    names = [t.name.encode() for t in read_header(tiny_model).tensors][:20]
    c, remote, base = _connect(port)
    dropped = 0

    def status(buffer: int) -> tuple[int, int, int]:
        a, b, n = struct.unpack("<QQQ", c.call(Cmd.GGUF_STATUS, struct.pack("<Q", buffer)))
        return a, b, n

    def read(offset: int, size: int) -> bytes:
        t = pack_rpc_tensor(ggml_type=0, buffer=remote, ne=(size // 4, 1, 1, 1), nb=(4, size, size, size),
                            data=base + offset, name=b"x")  # fmt: skip
        return c.call(Cmd.GET_TENSOR, t + struct.pack("<QQ", 0, size))

    near = st.one_of(st.integers(0, BUF), st.integers(-4096, BUF + 4096), U64.map(lambda v: v - base))
    name = st.one_of(st.sampled_from(names), st.binary(max_size=64))

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        name=name, ggml_type=st.integers(0, 2**32 - 1), ne=st.tuples(*[st.integers(0, 2**32 - 1)] * 4),
        nb=st.tuples(*[st.integers(0, 2**32 - 1)] * 4), at=near, buffer=st.one_of(st.just(-1), U64),
        offset=st.one_of(st.integers(0, 8192), U64), size=st.one_of(st.integers(0, 8192), U64),
        status_of=st.one_of(st.just(-1), U64),
    )  # fmt: skip
    def one(name: bytes, ggml_type: int, ne: tuple[int, int, int, int], nb: tuple[int, int, int, int], at: int,
            buffer: int, offset: int, size: int, status_of: int) -> None:  # fmt: skip
        nonlocal c, remote, base, dropped
        t = pack_rpc_tensor(ggml_type=ggml_type, buffer=remote if buffer < 0 else buffer, ne=ne, nb=nb,
                            data=(base + at) % 2**64, name=name[:64])  # fmt: skip
        try:
            c.send(Cmd.SET_TENSOR_GGUF, t + struct.pack("<QQ", offset, size))
            status(remote if status_of < 0 else status_of)  # answers, whatever the buffer id
        except OSError:  # a tensor the server cannot even parse (a type past the last one): it drops the client
            dropped += 1
            c.close()
            c, remote, base = _connect(port)
        assert srv.alive(), "the patched rpc-server died"

    one()
    print(f"\nfuzzed loads: the server dropped the client on {dropped} unparsable tensors and stayed up")
    # the connection still does real work: a valid load, read back
    c.send(Cmd.BUFFER_CLEAR, struct.pack("<QB", remote, 0))
    before = status(remote)
    t = pack_rpc_tensor(ggml_type=0, buffer=remote, ne=(640, 1, 1, 1), nb=(4, 2560, 2560, 2560), data=base,
                        name=b"output_norm.weight")  # fmt: skip
    c.send(Cmd.SET_TENSOR_GGUF, t + struct.pack("<QQ", 0, 2560))
    after = status(remote)
    assert after[0] == before[0] + 1, (before, after)
    assert read(0, 2560) == tiny_model.read_bytes()[norm.offset : norm.offset + norm.nbytes]
    c.close()
    assert srv.alive()

    # HELLO with arbitrary capability bytes (our patch reads them: the GGUF marker and the fingerprint): each on a
    # new connection (the server serves one client at a time), answered with a reply of the right size or closed
    marked = st.binary(max_size=CONN_CAPS_SIZE - 1).map(lambda b: GGUF_CAPS_MAGIC + b"\x01" + b)

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(caps=st.one_of(st.binary(min_size=CONN_CAPS_SIZE, max_size=CONN_CAPS_SIZE), marked))
    def hello(caps: bytes) -> None:
        h = RpcClient(port)
        try:
            h.send(Cmd.HELLO, caps[:CONN_CAPS_SIZE])
            (n,) = struct.unpack("<Q", h.recv_exact(8))
            assert n == HELLO_REPLY_SIZE
            h.recv_exact(n)
        except TimeoutError:
            raise AssertionError("the patched rpc-server hung on a HELLO") from None
        except OSError:
            pass  # refused (closed): fine
        finally:
            h.close()
        assert srv.alive(), "the patched rpc-server died on a HELLO"

    hello()


def test_set_tensor_delta_survives_arbitrary_runs_and_patches_only_its_copy(
    patched_bins: Binaries, tiny_model: Path, tmp_path: Path, children: list[Child]
) -> None:
    """Patch 0014's SET_TENSOR_DELTA with arbitrary sizes, run tables and frame lengths, against a real buffer: the
    server stays up (a bad frame closes the connection), and afterwards a whole input then a patch of it read back
    as the client's bytes."""
    port = free_port()
    srv = Child.start("rpc", rpc_server_argv(patched_bins, port, threads=1, gguf=tiny_model), tmp_path / "rpc.log")
    children.append(srv)
    wait_tcp_ready(srv, port)
    c, remote, base = _connect(port)

    def tensor(at: int, size: int) -> bytes:  # (the server reads its buffer and address only: the shape is a guess)
        n = min(max(size // 4, 1), 2**32 - 1)
        return pack_rpc_tensor(ggml_type=0, buffer=remote, ne=(n, 1, 1, 1), nb=(4, 4 * n, 4 * n, 4 * n) if n < 2**30
                               else (4, 4, 4, 4), data=(base + at) % 2**64, name=b"in")  # fmt: skip

    def delta(at: int, size: int, runs: list[tuple[int, int]], data: bytes, n_runs: int | None = None) -> bytes:
        head = struct.pack("<QQI", 0, size, len(runs) if n_runs is None else n_runs)
        return tensor(at, size) + head + b"".join(struct.pack("<II", s, n) for s, n in runs) + data

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(at=st.one_of(st.integers(0, BUF), st.integers(-4096, BUF + 4096)), size=st.one_of(st.integers(0, 4096), U64),
           runs=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=4),
           data=st.binary(max_size=512), n_runs=st.one_of(st.none(), st.integers(0, 2**32 - 1)))  # fmt: skip
    def one(at: int, size: int, runs: list[tuple[int, int]], data: bytes, n_runs: int | None) -> None:
        nonlocal c, remote, base
        try:
            c.send(Cmd.SET_TENSOR_DELTA, delta(at, size, runs, data, n_runs))
            c.call(Cmd.BUFFER_GET_BASE, struct.pack("<Q", remote))  # still serving this connection?
        except OSError:
            c.close()
            c, remote, base = _connect(port)
        assert srv.alive(), "the patched rpc-server died on a SET_TENSOR_DELTA"

    one()
    whole = bytes(range(256)) * 4
    c.send(Cmd.SET_TENSOR_DELTA, delta(64, 1024, [(0, 1024)], whole))
    c.send(Cmd.BUFFER_CLEAR, struct.pack("<QB", remote, 7))  # the memory reused in between: the copy is whole
    c.send(Cmd.SET_TENSOR_DELTA, delta(64, 1024, [(16, 4), (1000, 2)], b"ABCDxy"))
    got = c.call(Cmd.GET_TENSOR, tensor(64, 1024) + struct.pack("<QQ", 0, 1024))
    want = bytearray(whole)
    want[16:20], want[1000:1002] = b"ABCD", b"xy"
    assert got == bytes(want)
    c.close()
    assert srv.alive()
