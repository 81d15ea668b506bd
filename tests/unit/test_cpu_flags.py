"""CPU instruction flags of a build: never AMX, never -march=native on x86, a safer level to fall
back to, and the one-line diagnosis of a llama-server that dies."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from meshllm.llama import build as b
from meshllm.llama import hardware as hw
from meshllm.llama import processes
from meshllm.llama.processes import AMX_MARKER, describe_exit, explain_crash, uses_amx

# /proc/cpuinfo flags of the AMX machine where the first command crashed (Sapphire Rapids, trimmed)
SPR = hw.cpu_flags(
    "flags\t: fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt avx f16c bmi1 avx2 bmi2 avx512f avx512dq "
    "avx512ifma avx512cd "
    "avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni amx_bf16 avx512_fp16 amx_tile "
    "amx_int8"
)
HASWELL = hw.cpu_flags("flags\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 popcnt avx f16c bmi1 avx2 bmi2")
OLD = hw.cpu_flags("flags\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx")  # Sandy Bridge: no AVX2


def on(flags: tuple[str, ...]) -> set[str]:
    return {f[2:-3] for f in flags if f.endswith("=ON")}


def test_native_takes_every_extension_of_this_cpu_but_amx() -> None:
    flags = hw.cpu_cmake_flags("native", SPR, machine="x86_64")
    assert "-DGGML_NATIVE=OFF" in flags  # -march=native would turn the crashing AMX kernels on
    assert on(flags) == {
        "GGML_SSE42", "GGML_AVX", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX2", "GGML_AVX_VNNI",
        "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
    }  # fmt: skip
    for amx in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert f"-D{amx}=OFF" in flags
    assert on(hw.cpu_cmake_flags("native", HASWELL, machine="x86_64")) == set(hw.X86_PORTABLE)


def test_portable_and_generic_do_not_depend_on_this_cpu() -> None:
    assert hw.cpu_cmake_flags("portable", SPR, "x86_64") == hw.cpu_cmake_flags("portable", OLD, "x86_64")
    assert on(hw.cpu_cmake_flags("portable", SPR, "x86_64")) == set(hw.X86_PORTABLE)
    assert on(hw.cpu_cmake_flags("generic", SPR, "x86_64")) == set()


def test_other_architectures_let_the_compiler_choose() -> None:
    assert hw.cpu_cmake_flags("native", frozenset(), machine="aarch64") == ("-DGGML_NATIVE=ON",)
    assert hw.cpu_cmake_flags("portable", frozenset(), machine="aarch64") == ("-DGGML_NATIVE=OFF",)


def test_safer_levels_end() -> None:
    assert hw.safer_level("native", SPR) == "portable"
    assert hw.safer_level("native", OLD) == "generic"  # a portable build would not run on a CPU without AVX2
    assert hw.safer_level("portable", SPR) == "generic"
    assert hw.safer_level("generic", SPR) is None


def test_cpuinfo_parsing() -> None:
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_int8\nbugs\t\t: spectre_v1\n"
    assert hw.cpu_flags(text) == {"fpu", "avx2", "amx_int8"}
    assert hw.cpu_flags("no flags here\n") == frozenset()


def test_levels_are_separate_builds(tmp_path: Path) -> None:
    kw = {"stock": True, "backend": "cpu", "cache": tmp_path, "cpuinfo_flags": SPR}
    native = b.plan_build(cpu_level="native", **kw)  # type: ignore[arg-type]
    portable = b.plan_build(cpu_level="portable", **kw)  # type: ignore[arg-type]
    assert native.key != portable.key and native.dir != portable.dir
    assert "-portable-" in portable.dir.name and "-native-" in native.dir.name
    assert "-DCMAKE_BUILD_RPATH=$ORIGIN/../lib" in portable.cmake_flags  # bundles ship libs in ../lib
    assert not any("RPATH" in f for f in native.cmake_flags)
    # the CPU is part of the key: a cache carried to a machine with other extensions builds anew
    assert b.plan_build(cpu_level="native", **{**kw, "cpuinfo_flags": HASWELL}).key != native.key  # type: ignore[arg-type]
    assert hw.describe_cpu_flags(portable.cmake_flags) == "SSE42 AVX F16C FMA BMI2 AVX2"


def test_a_level_that_failed_its_self_test_here_is_skipped(tmp_path: Path) -> None:
    kw = {"stock": True, "backend": "cpu", "cache": tmp_path, "cpuinfo_flags": SPR}
    assert b.plan_build(**kw).cpu_level == "native"  # type: ignore[arg-type]
    native = b.plan_build(cpu_level="native", **kw)  # type: ignore[arg-type]
    native.failed_marker.parent.mkdir(parents=True)
    native.failed_marker.write_text("{}")
    assert b.plan_build(**kw).cpu_level == "portable"  # type: ignore[arg-type]
    b.plan_build(cpu_level="portable", **kw).failed_marker.write_text("{}")  # type: ignore[arg-type]
    assert b.plan_build(**kw).cpu_level == "generic"  # type: ignore[arg-type]


def test_exits_are_named() -> None:
    assert describe_exit(-signal.SIGSEGV) == "SIGSEGV"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(None) == "still running"


def test_crash_causes() -> None:
    # both ways AMX kernels were seen to die: SIGSEGV (the machine), SIGILL at tilezero (this one's)
    assert "AMX kernels" in explain_crash(-signal.SIGSEGV, "", amx=True)
    assert "AMX kernels" in explain_crash(-signal.SIGILL, "", amx=True)
    assert "AMX" not in explain_crash(-signal.SIGSEGV, "", amx=False)
    assert "instructions this CPU lacks" in explain_crash(-signal.SIGILL, "")
    assert "out of memory" in explain_crash(-signal.SIGKILL, "")
    assert "could not load the model" in explain_crash(1, "llama_model_load: error loading model: bad magic")
    for rc, text in [(-signal.SIGILL, ""), (1, "error loading model"), (-signal.SIGSEGV, "")]:
        assert "\n" not in explain_crash(rc, text) and "fix" in explain_crash(rc, text)


def test_amx_kernels_are_found_in_a_binary(tmp_path: Path) -> None:
    exe = tmp_path / "llama-server"
    exe.write_bytes(b"\x7fELF" + bytes(100) + AMX_MARKER + bytes(100))
    assert uses_amx(exe, SPR)
    assert not uses_amx(exe, HASWELL)  # the CPU would never run them
    exe.write_bytes(b"\x7fELF" + bytes(300))
    assert not uses_amx(exe, SPR)


def test_a_port_picked_for_one_listener_is_not_picked_again_for_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may offer the same free port twice while neither child has bound it yet (CI once saw an
    rpc-server's loopback port equal its TLS port: it failed to start five times)."""
    offered = iter([46107, 46107, 46108])

    class Sock:
        def __enter__(self) -> Sock:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(processes, "_ephemeral_start", lambda: 0)  # no room below it: the kernel picks
    monkeypatch.setattr(processes.sockets, "bound", lambda *a: Sock())
    assert processes.free_port() == 46107
    assert processes.free_port(avoid=[46107]) == 46108


def test_a_port_is_picked_below_the_kernel_s_ephemeral_range_and_in_use_or_avoided_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CI run lost a node's API port between the pick and the node's bind: the kernel hands ports to outgoing
    connections (and to binds to port 0) from its ephemeral range, so the pick is below it."""
    monkeypatch.setattr(processes, "_ephemeral_start", lambda: 32768)
    picks = [processes.free_port() for _ in range(50)]
    assert all(processes.PICK_FROM <= p < 32768 for p in picks), picks
    held = processes.sockets.bound("127.0.0.1", picks[0], socket.SOCK_STREAM)
    held.listen()
    try:
        a, b = [p for p in picks[1:] if p != picks[0]][:2]
        offered = iter([picks[0], a, b])
        monkeypatch.setattr(processes.random, "randrange", lambda lo, hi: next(offered))
        assert processes.free_port(avoid=[a]) == b  # in use, then avoided
    finally:
        held.close()
