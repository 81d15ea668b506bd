"""The import graph reads cli → serve → net → machine → llama → models, with proto beside (below all but llama and
models) and four leaves at the top (errors, paths, sockets, delaytcp), with no circle: the network knows nothing of
llama.cpp, llama.cpp's shells nothing of the protocol, and the protocol cores only themselves, the standard library
and pure libraries."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshllm"


def imports() -> dict[str, set[str]]:
    """Module -> the meshllm modules it imports (any import statement, lazy ones inside functions too)."""
    mods: dict[str, set[str]] = {}
    for p in SRC.rglob("*.py"):
        name = ".".join(("meshllm", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshllm"):
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("meshllm")}
        mods[name] = deps
    return {k: {d for d in v if d in mods and d != k} for k, v in mods.items()}


def test_no_import_circle() -> None:
    graph = imports()
    done: set[str] = set()

    def visit(n: str, path: list[str]) -> None:
        for d in graph[n]:
            assert d not in path, " -> ".join([*path[path.index(d) :], d])
            if d not in done:
                visit(d, [*path, d])
        done.add(n)

    for m in graph:
        visit(m, [m])


LAYERS = {  # each package of meshllm and what it may never import (its docstring says what it may)
    "meshllm.proto": ("meshllm.net", "meshllm.serve", "meshllm.llama", "meshllm.models", "meshllm.cli",
                      "meshllm.machine"),
    "meshllm.models": ("meshllm.proto", "meshllm.net", "meshllm.serve", "meshllm.llama", "meshllm.cli",
                       "meshllm.machine"),
    "meshllm.llama": ("meshllm.serve", "meshllm.net", "meshllm.cli", "meshllm.proto", "meshllm.machine"),
    "meshllm.machine": ("meshllm.net", "meshllm.serve", "meshllm.cli"),
    "meshllm.net": ("meshllm.serve", "meshllm.cli", "meshllm.llama"),
    "meshllm.serve": ("meshllm.cli",),
    "meshllm.cli": (),
}  # fmt: skip
LEAVES = {  # the modules left at the top: each imports only the leaves before it
    "meshllm.errors": (),
    "meshllm.paths": ("meshllm.errors",),
    "meshllm.sockets": (),
    "meshllm.delaytcp": ("meshllm.sockets",),
}


def test_layers_import_only_downwards() -> None:
    for mod, deps in imports().items():
        for layer, forbidden in LAYERS.items():
            if mod.startswith(layer + ".") or mod == layer:
                bad = sorted(d for d in deps if d.startswith(forbidden))
                assert not bad, f"{mod} imports {bad}"


def test_every_package_has_its_layer_and_says_what_it_may_import() -> None:
    """The rules above cover the whole tree: a new package gets its rule (and a docstring naming what it may import),
    a new module at the top is a leaf (at most eight modules there), and no package waits unnamed."""
    for init in SRC.rglob("__init__.py"):
        parts = init.parent.relative_to(SRC).parts
        if not parts:
            continue
        name = ".".join(("meshllm", *parts))
        assert name in LAYERS or (parts[0] == "serve" and len(parts) == 2 and parts[1] in SERVE), name
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in doc, f"{init.relative_to(SRC)}: its docstring does not say what it may import"
    top = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert top == {m.split(".")[1] for m in LEAVES} and len(top) + 1 <= 8, sorted(top)
    graph = imports()
    for leaf, allowed in LEAVES.items():
        assert graph[leaf] <= set(allowed), f"{leaf} imports {sorted(graph[leaf] - set(allowed))}"


PURE = {"msgpack", "cryptography"}  # libraries with no I/O of their own that the protocol cores may use
NEUTRAL = {"meshllm.errors"}  # the leaf of our own, importing nothing of meshllm, that the protocol cores may use


def test_the_protocol_cores_import_only_themselves_the_standard_library_and_pure_libraries() -> None:
    """``proto/`` takes ``now`` and does no I/O, so it imports no asyncio shell, no llama.cpp, no
    aiohttp or psutil — read from the source of every module there, lazy imports too."""
    for p in sorted((SRC / "proto").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                ok = (name.startswith("meshllm.proto") or name in NEUTRAL or top in PURE or top == "__future__"
                      or (top in sys.stdlib_module_names and top not in ("asyncio", "socket", "subprocess")))
                assert ok, f"{p.relative_to(SRC)} imports {name}"
    for leaf in NEUTRAL:
        assert not imports()[leaf], f"{leaf} must import nothing of meshllm"


SERVE = {  # what each package of serve/ may import of the others (its docstring says the same)
    "http": set(),
    "fetch": {"options"},
    "split": {"fetch", "http", "options"},
    "life": {"fetch", "split", "report", "options"},
    "report": {"http", "split", "life"},  # life: the console's approve and refuse buttons (life/lan.py)
}


def test_each_package_of_serve_imports_only_the_packages_its_docstring_names() -> None:
    for mod, deps in imports().items():
        parts = mod.split(".")
        if len(parts) < 4 or parts[:2] != ["meshllm", "serve"] or parts[2] not in SERVE:
            continue
        for d in deps:
            dp = d.split(".")
            if dp[:2] == ["meshllm", "serve"] and len(dp) > 2 and dp[2] != parts[2]:
                assert dp[2] in SERVE[parts[2]], f"{mod} imports {d}"


BENCH = SRC.parents[1] / "benchmarks"
SHARED = {"loadgen", "common"}  # the helpers every benchmark may import; benchmarks never import each other


def test_benchmarks_import_only_the_shared_helpers() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert scripts >= SHARED
    for p in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in scripts - SHARED or top == p.stem, f"benchmarks/{p.name} imports {name}"
                assert p.stem not in SHARED or top not in SHARED - {p.stem}, f"benchmarks/{p.name} imports {name}"


def test_no_module_is_over_500_lines_and_the_node_is_wired_in_300() -> None:
    """A module past 500 lines holds more than one capability (split it by capability, not by size); the one place
    that wires a node stays short enough to read at once."""
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
    assert len((SRC / "serve" / "node.py").read_text().splitlines()) <= 300
