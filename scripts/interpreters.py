"""Every Python this machine has runs mesh-llm: for each interpreter found (the system's ``/usr/bin/python3*``,
``/usr/local/bin/python3*`` and every pyenv version), one of 3.11 or later gets a venv of its own (kept in the
cache), mesh-llm installed into it with the test tools, ``mesh-llm --help``, the llama.cpp source extracted from the
pinned sdist by the build's own code (Debian 12's 3.11.2 once failed there: no tarfile data filter), and the unit
tests. The Python the suite itself runs under (the one ``scripts/setup`` picked) is only listed: every other step
of ``just test`` runs under it. An older one is listed as what ``scripts/setup`` replaces. Prints a table; exits 1
when any fails.

python scripts/interpreters.py
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from meshllm.llama.source import PINNED  # noqa: E402
from meshllm.paths import cache_dir  # noqa: E402

EXTRACT = """
import os, sys
from pathlib import Path
from meshllm.llama.source import PINNED, fetch_pinned_source
cache = Path(sys.argv[1])
tree = fetch_pinned_source(cache, say=lambda line: None)
assert (tree / "CMakeLists.txt").is_file() and (tree / "tools" / "rpc").is_dir(), tree
print(sum(len(f) for _, _, f in os.walk(tree)), "files")
"""


def interpreters() -> list[Path]:
    """Each distinct interpreter on this machine (by its real path)."""
    found = [*glob.glob("/usr/bin/python3*"), *glob.glob("/usr/local/bin/python3*"),
             *glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python3"))]  # fmt: skip
    out: dict[Path, Path] = {}
    for f in sorted(found):
        p = Path(f)
        if p.name.endswith("-config") or not os.access(p, os.X_OK):
            continue
        out.setdefault(p.resolve(), p)
    return list(out.values())


def version(py: Path) -> tuple[int, ...] | None:
    r = subprocess.run([str(py), "-c", "import sys; print(*sys.version_info[:3])"], capture_output=True, text=True)
    return tuple(int(x) for x in r.stdout.split()) if r.returncode == 0 else None


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]


def check(py: Path, v: tuple[int, ...], sdist: Path) -> str:
    """'' when mesh-llm installs, answers --help and extracts the source under ``py``; else what failed."""
    tag = hashlib.sha256(str(py.resolve()).encode()).hexdigest()[:8]
    venv = cache_dir() / "pythons" / f"{'.'.join(map(str, v))}-{tag}"
    if not (venv / "bin" / "python").exists():
        made = run([str(py), "-m", "venv", str(venv)])
        if made.returncode != 0 and "ensurepip" in made.stdout + made.stderr and os.geteuid() == 0:
            pkg = f"python{v[0]}.{v[1]}-venv"  # Debian and Ubuntu split venv's pip out of the interpreter
            run(["apt-get", "install", "-y", "-q", "--no-install-recommends", pkg],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
            shutil.rmtree(venv, ignore_errors=True)
            made = run([str(py), "-m", "venv", str(venv)])
        if made.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            return f"venv: {(made.stderr or made.stdout).strip().splitlines()[-1:]}"
    pip = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"])
    if pip.returncode != 0:
        return f"pip install: {pip.stderr.strip().splitlines()[-1:]}"
    helped = run([str(venv / "bin" / "mesh-llm"), "--help"])
    if helped.returncode != 0 or "usage:" not in helped.stdout:
        return f"mesh-llm --help: {(helped.stderr or helped.stdout).strip().splitlines()[-1:]}"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "src").mkdir()
        try:
            os.link(sdist, Path(tmp) / "src" / sdist.name)
        except OSError:
            shutil.copyfile(sdist, Path(tmp) / "src" / sdist.name)
        got = run([str(venv / "bin" / "python"), "-c", EXTRACT, tmp])
        if got.returncode != 0:
            return f"source extraction: {got.stderr.strip().splitlines()[-1:]}"
    if same_python(py, Path(sys.executable)):
        return ""
    tests = run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"], cwd=ROOT)
    if tests.returncode != 0:
        return f"unit tests: {tests.stdout.strip().splitlines()[-1:]}"
    return ""


def same_python(py: Path, other: Path) -> bool:
    """Whether ``other`` (an interpreter or a venv's) runs on ``py``."""
    ask = "import os, sys; print(os.path.realpath(sys._base_executable))"
    return run([str(py), "-c", ask]).stdout == run([str(other), "-c", ask]).stdout


def main() -> int:
    sdist = cache_dir() / "src" / PINNED.sdist
    if not sdist.is_file():
        print(f"{sdist} is missing: run `mesh-llm build` first (it downloads the pinned source)")
        return 1
    rows, failed = [], 0
    for py in interpreters():
        v = version(py)
        if v is None:
            rows.append((str(py), "?", "does not run"))
            continue
        shown = ".".join(map(str, v))
        if v < (3, 11):
            rows.append((str(py), shown, "older than 3.11: scripts/setup takes another (or installs python3.11)"))
            continue
        why = check(py, v, sdist)
        failed += bool(why)
        ok = ("ok: the suite's own Python (every step of `just test`)" if same_python(py, Path(sys.executable))
              else "ok: installs, --help, extracts the source, unit tests pass")  # fmt: skip
        rows.append((str(py), shown, f"FAILED: {why}" if why else ok))
    print(f"$ python {' '.join(sys.argv)}\n\n| interpreter | version | result |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
