"""Build the two binaries we run from the pinned source with our patch series (``source.py``) and the flags this
machine calls for (``hardware.py``), and cache them.

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
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from meshllm.errors import BuildError
from meshllm.llama.hardware import (
    backend_flags,
    check_toolchain,
    cpu_cmake_flags,
    cpu_flags,
    describe_cpu_flags,
    detect_backend,
    find_nvcc,
    openssl_dev_found,
    safer_level,
)
from meshllm.llama.source import (
    PINNED,
    _copy_ignore_for,
    default_patch_dir,
    fetch_pinned_source,
    hash_patches,
    hash_tree,
    read_series,
)
from meshllm.paths import cache_dir

RPC_SERVER = "ggml-rpc-server"
LLAMA_SERVER = "llama-server"
TARGETS = (RPC_SERVER, LLAMA_SERVER)


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


        # links, devices and the like: none in the pinned sdist's tree, and none is made


# --------------------------------------------------------------------------------------------- build


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
