"""What this machine gives a build: its CPU's instruction-set extensions and the flags for each CPU level (never AMX,
never -march=native on x86), which GPU backend it can build for (a visible NVIDIA GPU with a CUDA toolkit, Metal,
Vulkan headers and shader compiler) and whether the tools are there, with one line naming what is missing."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from meshllm.errors import BuildError
from meshllm.llama.source import PINNED

BACKENDS = ("cpu", "cuda", "metal", "vulkan")

# ggml's own default (GGML_NATIVE=ON) compiles with -march=native. On an Intel CPU with AMX (Sapphire Rapids and
# later) that turns on ggml's AMX kernels, and in the pinned llama.cpp those crash with SIGSEGV in
# ggml_backend_amx_mul_mat on the first decode (upstream llama.cpp issue 20824, still open). -march=native also
# ties a build to the machine that made it. So we never use it on x86: we name every instruction-set extension
# ourselves — the ones this CPU has, AMX always off — and the choice is part of the build's cache key.

# (ggml cmake option, the /proc/cpuinfo flags it needs)
X86_EXTENSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)


# Always off: the AMX kernels crash in the pinned llama.cpp (see above).
X86_NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


# x86-64-v3 (Haswell, 2013, and every x86 server and desktop CPU since): what a portable build assumes.
X86_PORTABLE = frozenset({"GGML_SSE42", "GGML_AVX", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX2"})


X86_PORTABLE_CPU_FLAGS = ("sse4_2", "avx", "f16c", "fma", "bmi2", "avx2")


CPU_LEVELS = ("native", "portable", "generic")
"""native: every extension this CPU has (AMX excepted); portable: x86-64-v3, runs on any x86 CPU from 2013 on;
generic: the compiler's baseline (x86-64: SSE2), for CPUs without AVX2. On other architectures native means the
compiler's -mcpu/-march=native and portable and generic its default target."""


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686", "i386")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of this CPU as Linux lists them (empty when unknown)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def safer_level(level: str, flags: frozenset[str]) -> str | None:
    """The level a build retries with when ``level`` built binaries that crash; None: nothing safer."""
    if level == "native":
        return "portable" if set(X86_PORTABLE_CPU_FLAGS) <= flags or not is_x86() else "generic"
    if level == "portable":
        return "generic"
    return None


def cpu_cmake_flags(level: str, flags: frozenset[str], machine: str | None = None) -> tuple[str, ...]:
    """The cmake flags that choose the CPU instructions ggml compiles for."""
    if level not in CPU_LEVELS:
        raise BuildError(f"unknown CPU level {level!r}: choose one of {', '.join(CPU_LEVELS)}")
    if not is_x86(machine):
        return ("-DGGML_NATIVE=ON",) if level == "native" else ("-DGGML_NATIVE=OFF",)
    if level == "native":
        on = {opt for opt, need in X86_EXTENSIONS if set(need) <= flags}
        if not flags:  # no /proc/cpuinfo: assume no more than a portable build would
            on = set(X86_PORTABLE)
    elif level == "portable":
        on = set(X86_PORTABLE)
    else:
        on = set()
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{opt}={'ON' if opt in on else 'OFF'}" for opt, _ in X86_EXTENSIONS]
    out += [f"-D{opt}=OFF" for opt in X86_NEVER]
    return tuple(out)


def describe_cpu_flags(cmake_flags: tuple[str, ...]) -> str:
    """'AVX2 FMA F16C …' for the extensions a set of cmake flags turns on (or how it targets the CPU)."""
    if "-DGGML_NATIVE=ON" in cmake_flags:
        return "-march=native"
    on = [f[len("-DGGML_") : -len("=ON")] for f in cmake_flags if f.startswith("-DGGML_") and f.endswith("=ON")]
    on = [o for o in on if o not in ("RPC", "CUDA", "METAL", "NATIVE")]
    return " ".join(on) if on else "no extensions (compiler baseline)"


def gpu_visible() -> bool:
    if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


CUDA_HOMES = ("/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/usr")  # where CUDA toolkits install themselves


CUDA_VERSIONED = Path("/usr/local")  # and /usr/local/cuda-X.Y beside the first


def find_nvcc() -> Path | None:
    """The CUDA compiler: ``$CUDACXX``, then PATH, then the toolkits where they live — ``$CUDA_HOME`` /
    ``$CUDA_PATH``, /usr/local/cuda, the newest /usr/local/cuda-X.Y, /opt/cuda, /usr/lib/cuda — since NVIDIA's
    installers leave /usr/local/cuda/bin off PATH (a GPU machine once built for the CPU without a word)."""
    env = os.environ.get("CUDACXX")
    if env and os.access(env, os.X_OK):
        return Path(env)
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    versioned = sorted(CUDA_VERSIONED.glob("cuda-*"), key=lambda p: _version_key(p.name[5:]), reverse=True)
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOMES[0], *map(str, versioned),
             *CUDA_HOMES[1:]]  # fmt: skip
    for home in homes:
        if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return Path(home) / "bin" / "nvcc"
    return None


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else -1 for x in text.split("."))


NO_TOOLKIT = ("a GPU is visible but no CUDA toolkit (nvcc) was found on PATH, in $CUDA_HOME or /usr/local/cuda*: "
              "building for the CPU — install the toolkit (Debian/Ubuntu: apt-get install nvidia-cuda-toolkit, or "
              "NVIDIA's cuda-toolkit package) and run `mesh-llm build` again")  # fmt: skip


def detect_backend(say: Callable[[str], None] | None = None) -> str:
    """CUDA when a CUDA toolkit is installed (``find_nvcc``) and a GPU is visible, Metal on macOS, else CPU;
    ``say`` hears one line when a GPU is visible without a toolkit (the build is the CPU's, not silently).

    nvcc alone is not enough: a CPU machine with the CUDA toolkit would spend an hour compiling kernels
    for a GPU it does not have.
    """
    if sys.platform == "darwin":
        return "metal"
    if gpu_visible():
        if find_nvcc() is not None:
            return "cuda"
        if say is not None:
            say(NO_TOOLKIT)
    return "cpu"


# A portable CUDA build carries kernels for every GPU generation CUDA 12 and 13 both support (Turing to Hopper),
# plus PTX that newer GPUs compile at load time.
PORTABLE_CUDA_ARCHS = "75-real;80-real;86-real;89-real;90-real;90-virtual"


def backend_flags(backend: str, portable: bool = False) -> tuple[str, ...]:
    if backend == "cuda":
        nvcc = find_nvcc()
        where = (f"-DCMAKE_CUDA_COMPILER={nvcc}",) if nvcc is not None and not shutil.which("nvcc") else ()
        return ("-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={PORTABLE_CUDA_ARCHS if portable else 'native'}",
                *where)  # fmt: skip
    if backend == "metal":
        return ("-DGGML_METAL=ON",)
    if backend == "vulkan":  # AMD and Intel GPUs without ROCm (any Vulkan driver)
        return ("-DGGML_VULKAN=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF")
    if backend == "cpu":
        return ("-DGGML_CUDA=OFF", "-DGGML_METAL=OFF")
    raise BuildError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def openssl_dev_found() -> bool:
    """OpenSSL's headers (Debian/Ubuntu: libssl-dev), which the patched build needs for its direct, TLS-protected
    RPC path. ``OPENSSL_ROOT_DIR`` (as cmake's FindOpenSSL reads it) names another installation."""
    roots = [Path(os.environ["OPENSSL_ROOT_DIR"])] if os.environ.get("OPENSSL_ROOT_DIR") else []
    return any((r / "include" / "openssl" / "ssl.h").is_file() for r in [*roots, Path("/usr"), Path("/usr/local")])


VULKAN_CORE = Path("/usr/include/vulkan/vulkan_core.h")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


SPIRV_CMAKE_DIRS = ("/usr/share/cmake", "/usr/lib/cmake", "/usr/local/share/cmake", "/usr/local/lib/cmake")


def check_toolchain(backend: str) -> None:
    if shutil.which("cmake") is None:
        raise BuildError("cmake not found: install the 'cmake' package (e.g. apt-get install cmake)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise BuildError("no C++ compiler found: install the 'g++' package (e.g. apt-get install build-essential)")
    if backend == "cuda" and find_nvcc() is None:
        raise BuildError("backend cuda needs the CUDA toolkit (nvcc: looked on PATH, in $CUDA_HOME and "
                         "/usr/local/cuda*): install it or use --backend cpu")  # fmt: skip
    if backend == "vulkan" and not (shutil.which("glslc") and Path("/usr/include/vulkan/vulkan.h").is_file()
                                    and any(Path(d, "SPIRV-Headers").is_dir() for d in SPIRV_CMAKE_DIRS)):
        raise BuildError("backend vulkan needs the Vulkan headers, the SPIR-V headers and the shader compiler: "
                         "apt-get install libvulkan-dev spirv-headers glslc")  # fmt: skip
    if backend == "vulkan" and "VK_EXT_layer_settings" not in _read(VULKAN_CORE):
        raise BuildError(f"the Vulkan headers here ({VULKAN_CORE}) are older than llama.cpp {PINNED.build} needs "
                         "(they lack VK_EXT_layer_settings; Debian 12 ships 1.3.239): install newer ones (the Vulkan "
                         "SDK, or a distribution's newer libvulkan-dev)")  # fmt: skip
    if not shutil.which("git"):
        raise BuildError("git not found (used to apply the patch series): install the 'git' package")
