"""Fetch the pinned llama.cpp source, apply our patch series, build the two binaries we run, cache them.

A build lives in ``<cache>/builds/<flavour>-<key>/`` where ``key`` hashes everything that changes the
binaries: the source tree, the patch series (none for ``--stock``), the backend's cmake flags, and the
machine. ``manifest.json`` is written last, so a directory without it is an unfinished build and is
redone. A second ``mesh-llm build`` with the same inputs finds the manifest and does nothing.

Layout of one build directory::

    src/         copy of the pristine tree with the patches applied
    cmake/       cmake's build tree (kept so an interrupted build resumes)
    bin/         ggml-rpc-server, llama-server
    build.log    everything cmake printed
    manifest.json
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import BuildError
from meshllm.paths import cache_dir, repo_root

RPC_SERVER = "ggml-rpc-server"
LLAMA_SERVER = "llama-server"
TARGETS = (RPC_SERVER, LLAMA_SERVER)


@dataclass(frozen=True)
class SourcePin:
    """The llama.cpp we build: upstream's tree as vendored in a llama-cpp-python sdist on PyPI."""

    package: str
    version: str
    sdist: str
    sha256: str
    subdir: str
    commit: str
    build: str


PINNED = SourcePin(
    package="llama-cpp-python",
    version="0.3.36",
    sdist="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    subdir="llama_cpp_python-0.3.36/vendor/llama.cpp",
    commit="0c1e57098",
    build="b11312",
)

# Top-level parts of the upstream tree the two targets never need; left out of each build's copy.
_SKIP_TOP = frozenset({"models", "docs", "media", ".git", "build"})


def _copy_ignore_for(root: Path) -> Callable[[str, list[str]], set[str]]:
    def ignore(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _SKIP_TOP} if Path(directory) == root else set()

    return ignore


BASE_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_RPC_RDMA=OFF",  # auto-enabled when libibverbs is installed; we need TCP only (and the HELLO caps)
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would fetch the web UI from the network at configure time
    "-DLLAMA_OPENSSL=OFF",  # llama-server only ever listens on 127.0.0.1 behind mesh-llm
)

BACKENDS = ("cpu", "cuda", "metal", "vulkan")

# ------------------------------------------------------------------------------------------ CPU flags
#
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


@dataclass(frozen=True)
class Binaries:
    rpc_server: Path
    llama_server: Path
    flavour: str  # "patched", "stock", "user" or "bundled"
    build_dir: Path | None = None

    def describe(self) -> str:
        return f"{self.flavour} binaries in {self.rpc_server.parent}"


@dataclass(frozen=True)
class BuildPlan:
    flavour: str
    source: Path | None  # None: the pinned sdist, fetched on demand
    source_hash: str
    patches: tuple[Path, ...]
    patches_hash: str
    backend: str
    cpu_level: str  # see CPU_LEVELS
    cmake_flags: tuple[str, ...]
    key: str
    dir: Path

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    def binaries(self) -> Binaries:
        return Binaries(
            rpc_server=self.bin_dir / RPC_SERVER,
            llama_server=self.bin_dir / LLAMA_SERVER,
            flavour=self.flavour,
            build_dir=self.dir,
        )

    @property
    def failed_marker(self) -> Path:
        """Written when binaries of this plan crashed in their self-test on this machine: never used again."""
        return self.dir.with_name(self.dir.name + ".failed.json")

    def is_built(self) -> bool:
        b = self.binaries()
        return self.manifest.is_file() and b.rpc_server.is_file() and b.llama_server.is_file()


# --------------------------------------------------------------------------------------------- inputs


def default_patch_dir() -> Path:
    env = os.environ.get("MESH_LLM_PATCHES")
    if env:
        return Path(env)
    root = repo_root()
    if root is None:
        raise BuildError(
            "cannot find patches/llama.cpp-rpc-local-gguf: run from a mesh-llm checkout or set MESH_LLM_PATCHES"
        )
    return root / "patches" / "llama.cpp-rpc-local-gguf"


def read_series(patch_dir: Path) -> tuple[Path, ...]:
    """The patches listed in ``series``, in order (blank lines and # comments skipped)."""
    series = patch_dir / "series"
    if not series.is_file():
        return ()
    out: list[Path] = []
    for raw in series.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        p = patch_dir / line
        if not p.is_file():
            raise BuildError(f"patch series lists {line} but {p} does not exist")
        out.append(p)
    return tuple(out)


def hash_patches(patches: tuple[Path, ...]) -> str:
    h = hashlib.sha256(b"mesh-llm patch series v1\n")
    for p in patches:
        h.update(p.name.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def hash_tree(root: Path) -> str:
    """Content hash of a user-supplied source tree (paths and bytes; build dirs and .git skipped)."""
    h = hashlib.sha256(b"mesh-llm tree v1\n")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "build", "models", "docs", "media"))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            h.update(str(p.relative_to(root)).encode() + b"\0")
            with p.open("rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


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


def plan_build(
    *,
    stock: bool = False,
    llama_src: Path | None = None,
    backend: str | None = None,
    patch_dir: Path | None = None,
    cache: Path | None = None,
    cpu_level: str | None = None,
    cpuinfo_flags: frozenset[str] | None = None,
) -> BuildPlan:
    """Work out what a build would be and where it lives, without doing anything.

    ``cpu_level`` None means native, unless a native build of the same inputs failed its self-test on this
    machine (see :func:`mark_failed`): then the level it fell back to.
    """
    cache = cache or cache_dir()
    backend = backend or detect_backend(_warn_once)
    flags_now = cpu_flags() if cpuinfo_flags is None else cpuinfo_flags
    if cpu_level is None:
        level: str | None = "native"
        while level is not None:
            plan = plan_build(
                stock=stock, llama_src=llama_src, backend=backend, patch_dir=patch_dir, cache=cache,
                cpu_level=level, cpuinfo_flags=flags_now,
            )  # fmt: skip
            if not plan.failed_marker.is_file():
                return plan
            level = safer_level(level, flags_now)
        return plan
    if llama_src is not None:
        llama_src = llama_src.expanduser().resolve()
        if not (llama_src / "CMakeLists.txt").is_file() or not (llama_src / "ggml").is_dir():
            raise BuildError(f"--llama-src {llama_src} does not look like a llama.cpp tree (no CMakeLists.txt/ggml)")
        source_hash = "tree:" + hash_tree(llama_src)
    else:
        source_hash = "sdist:" + PINNED.sha256
    if stock:
        patches: tuple[Path, ...] = ()
        patches_hash = "none"
    else:
        patches = read_series(patch_dir or default_patch_dir())
        patches_hash = hash_patches(patches)
    portable = cpu_level != "native"
    flags = BASE_CMAKE_FLAGS + backend_flags(backend, portable) + cpu_cmake_flags(cpu_level, flags_now)
    if portable:  # a bundle ships the shared libraries the binaries need (libgomp, ...) in ../lib beside bin/
        flags += ("-DCMAKE_BUILD_RPATH=$ORIGIN/../lib",)
    if not stock and openssl_dev_found():
        flags += ("-DGGML_RPC_TLS=ON",)  # the direct RPC path (patch 0005); without it: tunnels only
    ident = json.dumps(
        {
            "source": source_hash,
            "patches": patches_hash,
            "flags": flags,
            "machine": platform.machine(),
            "system": platform.system(),
        },
        sort_keys=True,
    )
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    flavour = "stock" if stock else "patched"
    return BuildPlan(
        flavour=flavour,
        source=llama_src,
        source_hash=source_hash,
        patches=patches,
        patches_hash=patches_hash,
        backend=backend,
        cpu_level=cpu_level,
        cmake_flags=flags,
        key=key,
        dir=cache / "builds" / f"{flavour}-{backend}-{cpu_level}-{key}",
    )


# --------------------------------------------------------------------------------------------- source


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_pinned_source(cache: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """The pristine upstream tree from the pinned sdist, downloaded and extracted once."""
    cache = cache or cache_dir()
    src_root = cache / "src"
    tree = src_root / f"llama.cpp-{PINNED.build}"
    if (tree / ".mesh-llm-complete").is_file():
        return tree
    src_root.mkdir(parents=True, exist_ok=True)
    sdist = src_root / PINNED.sdist
    if sdist.is_file() and _sha256_file(sdist) != PINNED.sha256:
        say(f"removing {sdist.name}: sha256 mismatch")
        sdist.unlink()
    if not sdist.is_file():
        say(f"downloading {PINNED.package}=={PINNED.version} (llama.cpp {PINNED.build}, ~77 MB) with pip")
        with tempfile.TemporaryDirectory(dir=src_root) as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "-q", "-d", tmp, f"{PINNED.package}=={PINNED.version}",
            ]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / PINNED.sdist
            if not got.is_file():
                # pip prepares metadata after downloading; that may fail without the build backend even though the
                # file is there. Only a missing file is an error.
                lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
                why = next((ln for ln in lines if "error" in ln.lower() or "×" in ln), lines[-1] if lines else "?")
                raise BuildError(f"pip download {PINNED.package}=={PINNED.version} failed: {why}")
            got.rename(sdist)
    digest = _sha256_file(sdist)
    if digest != PINNED.sha256:
        sdist.unlink()
        raise BuildError(f"{PINNED.sdist}: sha256 {digest} != pinned {PINNED.sha256}; removed it")
    say(f"extracting llama.cpp {PINNED.build} from {PINNED.sdist}")
    tmpdir = Path(tempfile.mkdtemp(dir=src_root, prefix=".extract-"))
    try:
        prefix = PINNED.subdir + "/"
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            _extract(tar, members, tmpdir)
        (tmpdir / ".mesh-llm-complete").write_text(json.dumps({"sdist_sha256": PINNED.sha256}))
        if tree.exists():
            shutil.rmtree(tree)
        tmpdir.rename(tree)
    finally:
        if tmpdir.exists():
            shutil.rmtree(tmpdir, ignore_errors=True)
    return tree


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """``members`` of ``tar`` under ``dest``, none outside it: with tarfile's "data" filter where this Python has it
    (3.11.4 and later), else (Debian 12's 3.11.2: ``extractall(filter=)`` is a TypeError there) only regular files
    and folders whose names stay inside, written with our own modes."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    root = dest.resolve()
    for m in members:
        target = (dest / m.name).resolve()
        if m.name.startswith("/") or (target != root and root not in target.parents):
            raise BuildError(f"{PINNED.sdist}: {m.name!r} would land outside the source tree")
        if m.isdir():
            target.mkdir(parents=True, exist_ok=True)
        elif m.isfile():
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            with src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(0o755 if m.mode & 0o100 else 0o644)
        # links, devices and the like: none in the pinned sdist's tree, and none is made


# --------------------------------------------------------------------------------------------- build


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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def parse_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja ``[12/345]`` or make ``[ 40%]`` line."""
    m = _NINJA_PROGRESS.match(line)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _MAKE_PROGRESS.match(line)
    if m:
        return int(m.group(1)), 100
    return None


ProgressFn = Callable[[str, int, int], None]


def _run_logged(cmd: list[str], *, cwd: Path, log: Path, env: dict[str, str], step: str, progress: ProgressFn) -> None:
    with log.open("a") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        tail: deque[str] = deque(maxlen=20)
        for line in proc.stdout:
            lf.write(line)
            tail.append(line.rstrip())
            p = parse_progress(line)
            if p is not None:
                progress(step, p[0], p[1])
        rc = proc.wait()
    if rc != 0:
        errors = [t for t in tail if "error" in t.lower()] or list(tail)[-1:]
        raise BuildError(f"{step} failed (exit {rc}): {errors[-1] if errors else ''} — full log: {log}")


_warned: set[str] = set()


def _warn_once(line: str) -> None:
    """A line for the user on stderr, once per process (a plan is worked out several times per command)."""
    if line not in _warned:
        _warned.add(line)
        print(f"mesh-llm: {line}", file=sys.stderr)


def _build_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    nvcc = find_nvcc()
    if nvcc is not None and not shutil.which("nvcc"):  # a toolkit off PATH: its tools (ptxas, fatbinary) beside it
        env["PATH"] = f"{nvcc.parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("CUDACXX", str(nvcc))
    # ccache (when installed) shares object files between the stock and patched builds and across keys.
    env.setdefault("CCACHE_DIR", str(cache / "ccache"))
    env.setdefault("CCACHE_BASEDIR", str(cache / "builds"))
    env.setdefault("CCACHE_NOHASHDIR", "true")
    env.setdefault("CCACHE_MAXSIZE", "5G")
    return env


class SelfTestFailed(BuildError):
    """Freshly built binaries crashed (or did not work) in their self-test; the build was not cached."""

    def __init__(self, problem: str, logs: Path) -> None:
        super().__init__(problem)
        self.logs = logs


Verifier = Callable[[Binaries, Path], str | None]
"""Runs freshly built binaries (second argument: a directory for their logs); returns a one-line problem or None."""


@dataclass(frozen=True)
class BuildResult:
    binaries: Binaries
    built: bool  # False: it was already in the cache
    seconds: float
    plan: BuildPlan


def build(
    plan: BuildPlan,
    *,
    jobs: int | None = None,
    say: Callable[[str], None] = print,
    progress: ProgressFn = lambda step, done, total: None,
    cache: Path | None = None,
    verify: Verifier | None = None,
) -> BuildResult:
    """Make sure the binaries for ``plan`` exist; build them if not. Safe to run concurrently.

    ``verify`` runs the new binaries before they are cached; when it reports a problem the build is marked
    failed on this machine (:attr:`BuildPlan.failed_marker`; later plans skip its CPU level), its compile tree
    is removed, and :class:`SelfTestFailed` is raised."""
    t0 = time.monotonic()
    if plan.is_built():
        return BuildResult(plan.binaries(), False, 0.0, plan)
    plan.failed_marker.unlink(missing_ok=True)  # asked for again explicitly: try again
    cache = cache or cache_dir()
    check_toolchain(plan.backend)
    with _locked(plan.dir.with_suffix(".lock")):
        if plan.is_built():  # somebody else finished it while we waited
            return BuildResult(plan.binaries(), False, time.monotonic() - t0, plan)
        pristine = plan.source or fetch_pinned_source(cache, say)
        plan.dir.mkdir(parents=True, exist_ok=True)
        log = plan.dir / "build.log"
        src = plan.dir / "src"
        stamp = plan.dir / "src.ready"
        if not stamp.is_file():
            say(f"preparing source ({len(plan.patches)} patch(es)) in {src}")
            if src.exists():
                shutil.rmtree(src)
            shutil.copytree(pristine, src, ignore=_copy_ignore_for(pristine), symlinks=True)
            if plan.patches:
                subprocess.run(["git", "init", "-q"], cwd=src, check=True)
                for p in plan.patches:
                    r = subprocess.run(
                        ["git", "apply", "--whitespace=nowarn", str(p)], cwd=src, capture_output=True, text=True
                    )
                    if r.returncode != 0:
                        first = (r.stderr.strip().splitlines() or ["?"])[0]
                        raise BuildError(f"patch {p.name} does not apply to this llama.cpp tree: {first}")
            stamp.write_text("ok\n")
        env = _build_env(cache)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        cmake_dir = plan.dir / "cmake"
        jobs = jobs or os.cpu_count() or 2
        say(f"configuring {plan.flavour} build ({plan.backend}); log: {log}")
        _run_logged(
            ["cmake", "-S", str(src), "-B", str(cmake_dir), *gen, *plan.cmake_flags],
            cwd=plan.dir, log=log, env=env, step="cmake configure", progress=progress,
        )  # fmt: skip
        say(f"compiling {', '.join(TARGETS)} with {jobs} job(s)")
        _run_logged(
            ["cmake", "--build", str(cmake_dir), "--target", *TARGETS, "-j", str(jobs)],
            cwd=plan.dir, log=log, env=env, step="compile", progress=progress,
        )  # fmt: skip
        plan.bin_dir.mkdir(exist_ok=True)
        for target in TARGETS:
            found = list(cmake_dir.glob(f"bin/{target}")) or list(cmake_dir.rglob(target))
            found = [f for f in found if f.is_file() and os.access(f, os.X_OK)]
            if not found:
                raise BuildError(f"build finished but {target} is missing under {cmake_dir}; see {log}")
            tmp = plan.bin_dir / f".{target}.tmp"
            shutil.copy2(found[0], tmp)
            tmp.replace(plan.bin_dir / target)
        if verify is not None:
            logs = plan.dir / "selftest"
            problem = verify(plan.binaries(), logs)
            if problem:
                record = {"problem": problem, "cmake_flags": list(plan.cmake_flags), "logs": str(logs),
                          "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
                plan.failed_marker.write_text(json.dumps(record, indent=2) + "\n")
                shutil.rmtree(plan.bin_dir, ignore_errors=True)
                shutil.rmtree(cmake_dir, ignore_errors=True)
                raise SelfTestFailed(problem, logs)
        manifest = {
            "flavour": plan.flavour,
            "key": plan.key,
            "source_hash": plan.source_hash,
            "source": str(plan.source) if plan.source else f"{PINNED.package}=={PINNED.version} {PINNED.commit}",
            "patches": [p.name for p in plan.patches],
            "patches_hash": plan.patches_hash,
            "backend": plan.backend,
            "cpu_level": plan.cpu_level,
            "cpu_extensions": describe_cpu_flags(plan.cmake_flags),
            "cmake_flags": list(plan.cmake_flags),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - t0, 1),
        }
        tmpm = plan.manifest.with_suffix(".tmp")
        tmpm.write_text(json.dumps(manifest, indent=2) + "\n")
        tmpm.replace(plan.manifest)
    for old in prune_builds(plan):
        say(f"removed an older {plan.flavour} build: {old}")
    return BuildResult(plan.binaries(), True, time.monotonic() - t0, plan)


def prune_builds(plan: BuildPlan, keep: int = 1) -> list[Path]:
    """After a new build: remove older builds of the same flavour and backend (other sources or patches), all but
    the ``keep`` newest, so patch iterations do not fill the disk (~170 MB each). A build another process holds
    the lock of is left alone; running binaries are unaffected (Linux keeps an unlinked file open)."""
    others = []
    old_layout = re.compile(rf"{plan.flavour}-{plan.backend}-[0-9a-f]{{16}}")  # before CPU levels: -march=native
    for d in plan.dir.parent.glob(f"{plan.flavour}-{plan.backend}-*"):
        if d == plan.dir or not d.is_dir():
            continue
        if not (d.name.startswith(f"{plan.flavour}-{plan.backend}-{plan.cpu_level}-") or old_layout.fullmatch(d.name)):
            continue
        m = d / "manifest.json"
        others.append((m.stat().st_mtime if m.is_file() else 0.0, d))
    removed = []
    for _, d in sorted(others, reverse=True)[keep:]:
        lock = d.with_suffix(".lock")
        with lock.open("w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            shutil.rmtree(d, ignore_errors=True)
        lock.unlink(missing_ok=True)
        removed.append(d)
    return removed


# --------------------------------------------------------------------------------------------- lookup


def user_binaries(bin_dir: Path) -> Binaries:
    """Binaries a user built themselves (``--bin-dir``). Older trees name the RPC server ``rpc-server``."""
    bin_dir = bin_dir.expanduser()
    rpc = next((bin_dir / n for n in (RPC_SERVER, "rpc-server") if (bin_dir / n).is_file()), None)
    server = bin_dir / LLAMA_SERVER
    missing = [n for n, p in ((RPC_SERVER, rpc), (LLAMA_SERVER, server)) if p is None or not p.is_file()]
    if missing:
        raise BuildError(f"--bin-dir {bin_dir}: missing {' and '.join(missing)}")
    assert rpc is not None
    return Binaries(rpc_server=rpc, llama_server=server, flavour="user")


BUNDLED_BIN_DIR = Path("share") / "mesh-llm" / "bin"


def bundled_binaries() -> Binaries | None:
    """The binaries a bundle's install script put beside this Python environment (``sys.prefix``), if any."""
    d = Path(sys.prefix) / BUNDLED_BIN_DIR
    if (d / RPC_SERVER).is_file() and (d / LLAMA_SERVER).is_file():
        return Binaries(rpc_server=d / RPC_SERVER, llama_server=d / LLAMA_SERVER, flavour="bundled")
    return None


def find_binaries(*, stock: bool = False, bin_dir: Path | None = None, backend: str | None = None) -> Binaries:
    """Binaries that are already built (or the user's), without building. One clear error otherwise.

    In order: ``bin_dir`` (--bin-dir), $MESH_LLM_BIN_DIR, a bundle's binaries (patched only), the build cache."""
    if bin_dir is None and os.environ.get("MESH_LLM_BIN_DIR") and not stock:  # the user's are never "stock"
        bin_dir = Path(os.environ["MESH_LLM_BIN_DIR"])
    if bin_dir is not None:
        return user_binaries(bin_dir)
    bundled = None if stock else bundled_binaries()
    if bundled is not None:
        return bundled
    plan = plan_build(stock=stock, backend=backend)
    if not plan.is_built():
        flag = " --stock" if stock else ""
        raise BuildError(f"llama.cpp binaries are not built yet: run `mesh-llm build{flag}` (or pass --bin-dir DIR)")
    return plan.binaries()
