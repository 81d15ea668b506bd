"""``mesh-llm bundle``: everything another machine needs to run mesh-llm, with no compiler and no package index.

A bundle is one .tar.gz holding::

    mesh-llm-bundle/
      install.sh        POSIX sh: a venv from the wheels (pip --no-index), the binaries beside it
      bin/              ggml-rpc-server, llama-server (patched, portable CPU flags: no -march=native)
      lib/              the shared libraries they link that are not part of glibc (libgomp, libstdc++, ...)
      wheels/           mesh-llm and every dependency, for each Python version asked for, and pip itself
      manifest.json     what was packed: build key, CPU flags, Python versions, sizes

The target must have the same OS family and CPU architecture (glibc Linux, x86_64 or aarch64) and Python >= 3.11.
After ``install.sh DIR``, ``DIR/bin/mesh-llm`` finds the binaries in ``DIR/share/mesh-llm/bin`` by itself.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meshllm import __version__
from meshllm.errors import UserError
from meshllm.llama import build as b
from meshllm.llama import hardware as hw
from meshllm.paths import repo_root

DEFAULT_PYTHONS = ("3.11", "3.12", "3.13")
TOP = "mesh-llm-bundle"

# Libraries of the C library itself (and the GPU driver): always the target's own, never shipped.
_SYSTEM_LIBS = re.compile(r"^(linux-vdso|linux-gate|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libcuda)\b")

_INSTALL_SH = r"""#!/bin/sh
# Install mesh-llm from this bundle: no compiler, no network.
#   ./install.sh [DIR]          (default: $HOME/.local/mesh-llm; then run DIR/bin/mesh-llm)
#   PYTHON=/path/to/python3.12 ./install.sh DIR
set -eu
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-$HOME/.local/mesh-llm}
py=${PYTHON:-python3}
fail() { echo "install.sh: $*" >&2; exit 1; }
command -v "$py" >/dev/null 2>&1 || fail "$py not found: install Python 3.11 or newer (or set PYTHON)"
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail "mesh-llm needs Python >= 3.11, $py is $ver"
[ "$(uname -m)" = "@MACHINE@" ] || fail "this bundle is for @MACHINE@, this machine is $(uname -m)"
for flag in @CPU_FLAGS@; do
  grep -qw "$flag" /proc/cpuinfo 2>/dev/null ||
    fail "this CPU lacks $flag, which the bundled binaries need: build from source"
done
case " @PYTHONS@ " in
  *" $ver "*) ;;
  *) fail "this bundle has wheels for Python @PYTHONS@, $py is $ver: set PYTHON=";;
esac
pipwhl=$(ls "$here"/wheels/pip-*.whl | head -n 1)
"$py" -m venv --without-pip "$dest" || fail "could not create a virtual environment in $dest"
PIP_CONFIG_FILE=/dev/null "$dest/bin/python" "$pipwhl/pip" install -q --no-index --disable-pip-version-check \
  --find-links "$here/wheels" "mesh-llm==@VERSION@" || fail "pip could not install the bundled wheels"
mkdir -p "$dest/share/mesh-llm/bin" "$dest/share/mesh-llm/lib"
cp "$here"/bin/* "$dest/share/mesh-llm/bin/"
if [ -n "$(ls "$here/lib")" ]; then cp "$here"/lib/* "$dest/share/mesh-llm/lib/"; fi
"$dest/share/mesh-llm/bin/llama-server" --version >/dev/null 2>&1 || fail "the bundled llama-server does not run here"
echo "installed mesh-llm @VERSION@ in $dest"
echo "  $dest/bin/mesh-llm --model MODEL.gguf --join TOKEN"
"""


def _run(cmd: Sequence[str], what: str, cwd: Path | None = None) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "?")
        raise UserError(f"{what} failed: {why.strip()}")


def shared_libraries(binary: Path) -> list[Path]:
    """The shared libraries ``binary`` loads that are not the C library's own (from ldd)."""
    r = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
    if r.returncode != 0:
        return []  # a static binary
    out = []
    for line in r.stdout.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if not arrow or _SYSTEM_LIBS.match(name):
            continue
        path = rest.split(" (")[0].strip()
        if path == "not found":
            raise UserError(f"{binary.name} needs {name}, which is not installed here")
        if path:
            out.append(Path(path))
    return out


def check_output(out: Path) -> Path:
    """Where the bundle goes, made absolute, once we know we can write there (before minutes of work)."""
    out = out.expanduser().resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.with_name(out.name + ".part").open("wb"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    return out


def make_bundle(
    out: Path,
    bins: b.Binaries,
    plan: b.BuildPlan,
    *,
    pythons: Sequence[str] = DEFAULT_PYTHONS,
    say: Callable[[str], None] = print,
) -> Path:
    """Pack ``bins`` (a portable build), mesh-llm's wheel and every dependency's wheels into ``out``."""
    root = repo_root()
    if root is None:
        raise UserError("mesh-llm bundle packs this source checkout: run it from one (git clone, scripts/setup)")
    if plan.cpu_level == "native":
        raise UserError("a bundle needs a portable build (mesh-llm build --cpu portable), not a native one")
    pythons = sorted(set(pythons) | {f"{sys.version_info[0]}.{sys.version_info[1]}"}, key=lambda v: int(v[2:]))
    out = check_output(out)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mesh-llm-bundle-") as tmp:
        stage = Path(tmp) / TOP
        for d in ("bin", "lib", "wheels"):
            (stage / d).mkdir(parents=True)
        for exe in (bins.rpc_server, bins.llama_server):
            shutil.copy2(exe, stage / "bin" / exe.name)
        libs = {lib.name: lib for exe in (bins.rpc_server, bins.llama_server) for lib in shared_libraries(exe)}
        for name, lib in sorted(libs.items()):
            shutil.copy2(lib.resolve(), stage / "lib" / name)
        wheels = stage / "wheels"
        say("building the mesh-llm wheel")
        pip = [sys.executable, "-m", "pip"]
        _run([*pip, "wheel", "-q", "--no-deps", "-w", str(wheels), str(root)], "pip wheel (mesh-llm)")
        ours = next(wheels.glob("mesh_llm-*.whl"))
        for v in pythons:
            say(f"downloading dependency wheels for Python {v}")
            _run(
                [*pip, "download", "-q", "--only-binary=:all:", "--python-version", v, "-d", str(wheels), str(ours)],
                f"pip download (Python {v})",
            )
        _run([*pip, "download", "-q", "--only-binary=:all:", "-d", str(wheels), "pip"], "pip download (pip)")
        needs = sorted(hw.X86_PORTABLE_CPU_FLAGS) if hw.is_x86() and plan.cpu_level == "portable" else []
        script = (
            _INSTALL_SH.replace("@MACHINE@", platform.machine())
            .replace("@CPU_FLAGS@", " ".join(needs))
            .replace("@PYTHONS@", " ".join(pythons))
            .replace("@VERSION@", __version__)
        )
        (stage / "install.sh").write_text(script)
        (stage / "install.sh").chmod(0o755)
        manifest = {
            "mesh_llm": __version__,
            "build_key": plan.key,
            "backend": plan.backend,
            "cpu_level": plan.cpu_level,
            "cpu_extensions": hw.describe_cpu_flags(plan.cmake_flags),
            "machine": platform.machine(),
            "pythons": pythons,
            "libraries": sorted(libs),
            "wheels": sorted(p.name for p in wheels.glob("*.whl")),
            "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        say(f"packing {out.name}")
        part = out.with_name(out.name + ".part")
        with tarfile.open(part, "w:gz") as tar:
            tar.add(stage, arcname=TOP)
        part.replace(out)
    say(f"bundle ready in {time.monotonic() - t0:.0f} s: {out} ({out.stat().st_size / 1e6:.0f} MB)")
    return out
