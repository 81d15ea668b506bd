"""The build cache key and the pieces of `mesh-llm build` that need no compiler."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from meshllm.cli.main import main
from meshllm.errors import BuildError
from meshllm.llama import build as b
from meshllm.llama import hardware as hw
from meshllm.llama import source


def _patch_dir(tmp_path: Path, body: bytes = b"diff --git a/x b/x\n") -> Path:
    d = tmp_path / "patches"
    d.mkdir(exist_ok=True)
    (d / "0001-x.patch").write_bytes(body)
    (d / "series").write_text("# comment\n\n0001-x.patch\n")
    return d


def test_parse_progress() -> None:
    assert b.parse_progress("[12/345] Building CXX object foo.o") == (12, 345)
    assert b.parse_progress("[ 40%] Built target ggml") == (40, 100)
    assert b.parse_progress("-- Configuring done") is None


def test_key_depends_on_every_input(tmp_path: Path) -> None:
    pd = _patch_dir(tmp_path)
    cache = tmp_path / "cache"
    patched = b.plan_build(patch_dir=pd, backend="cpu", cache=cache)
    assert patched.patches == (pd / "0001-x.patch",)
    # same inputs, same key: this is what makes a second build a no-op
    assert b.plan_build(patch_dir=pd, backend="cpu", cache=cache).key == patched.key
    stock = b.plan_build(stock=True, backend="cpu", cache=cache)
    assert stock.patches == () and stock.key != patched.key and stock.dir != patched.dir
    assert b.plan_build(patch_dir=pd, backend="cuda", cache=cache).key != patched.key
    (pd / "0001-x.patch").write_bytes(b"diff --git a/y b/y\n")
    assert b.plan_build(patch_dir=pd, backend="cpu", cache=cache).key != patched.key


def test_empty_series_differs_from_stock(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / "series").write_text("# nothing yet\n")
    assert source.read_series(d) == ()
    assert (
        b.plan_build(patch_dir=d, backend="cpu", cache=tmp_path).key
        != b.plan_build(stock=True, backend="cpu", cache=tmp_path).key
    )


def test_series_naming_a_missing_patch_is_an_error(tmp_path: Path) -> None:
    d = tmp_path / "p"
    d.mkdir()
    (d / "series").write_text("0001-gone.patch\n")
    with pytest.raises(BuildError, match=r"0001-gone\.patch"):
        source.read_series(d)


def test_llama_src_tree_hash_follows_content(tmp_path: Path) -> None:
    src = tmp_path / "llama.cpp"
    (src / "ggml").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    k1 = b.plan_build(stock=True, llama_src=src, backend="cpu", cache=tmp_path).key
    (src / "ggml" / "a.c").write_text("int a;\n")
    assert b.plan_build(stock=True, llama_src=src, backend="cpu", cache=tmp_path).key != k1
    with pytest.raises(BuildError, match="does not look like a llama\\.cpp tree"):
        b.plan_build(stock=True, llama_src=tmp_path / "nope", backend="cpu", cache=tmp_path)


def test_missing_cmake_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no cmake, no compiler
    with pytest.raises(BuildError, match=r"cmake not found: install the 'cmake' package"):
        hw.check_toolchain("cpu")


def test_missing_compiler_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "cmake").symlink_to("/bin/true")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError, match="no C\\+\\+ compiler found"):
        hw.check_toolchain("cpu")


def test_cli_bin_dir_without_binaries_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--bin-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing ggml-rpc-server and llama-server" in err and len(err.splitlines()) == 1


def test_cli_bin_dir_with_binaries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for n in ("rpc-server", "llama-server"):
        (tmp_path / n).write_text("#!/bin/sh\n")
    assert main(["build", "--bin-dir", str(tmp_path), "--print-dir"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)


def test_a_new_build_prunes_older_ones_of_its_kind_but_the_newest(tmp_path: Path) -> None:
    import fcntl
    import os

    cache = tmp_path / "cache"
    plan = b.plan_build(patch_dir=_patch_dir(tmp_path), backend="cpu", cache=cache)
    builds = plan.dir.parent
    old = ["patched-cpu-native-old1", "patched-cpu-native-old2", "patched-cpu-native-old3"]
    others = ["stock-cpu-native-x", "patched-cuda-native-y", "patched-cpu-portable-z"]
    for i, name in enumerate(["patched-cpu-0123456789abcdef", *old, *others]):  # the first: before CPU levels
        (builds / name / "bin").mkdir(parents=True)
        (builds / name / "manifest.json").write_text("{}")
        os.utime(builds / name / "manifest.json", (1000 + i, 1000 + i))
    plan.dir.mkdir(parents=True)
    with (builds / "patched-cpu-native-old1.lock").open("w") as held:  # somebody is building old1 right now
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = b.prune_builds(plan)
    # old3 is the newest kept; old1 is busy; other flavours, backends and CPU levels are not ours to prune
    assert sorted(p.name for p in removed) == ["patched-cpu-0123456789abcdef", "patched-cpu-native-old2"]
    left = sorted(p.name for p in builds.iterdir() if p.is_dir())
    assert left == sorted([old[0], old[2], plan.dir.name, *others])


def test_stock_binaries_never_come_from_the_users_bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in ("ggml-rpc-server", "llama-server"):
        (tmp_path / n).write_text("#!/bin/sh\n")
    monkeypatch.setenv("MESH_LLM_BIN_DIR", str(tmp_path))
    monkeypatch.setenv("MESH_LLM_CACHE", str(tmp_path / "empty-cache"))
    assert b.find_binaries().rpc_server.parent == tmp_path
    with pytest.raises(BuildError, match="build --stock"):
        b.find_binaries(stock=True)  # a comparison against "stock" must not silently compare patched with itself


def _tar_of(tmp_path: Path, names: dict[str, bytes]) -> Path:
    import io
    import tarfile

    out = tmp_path / "src.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for name, data in names.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o4755 if name.endswith(".sh") else 0o600
            tar.addfile(info, io.BytesIO(data))
    return out


# Both ways where this Python has the data filter (3.11.4 on); without it (Debian 12's 3.11.2, the suite's own Python
# there) only the fallback, and the filter's way runs in the unit tests of every newer Python (scripts/interpreters.py).
@pytest.mark.parametrize("has_filter", [True, False] if hasattr(tarfile, "data_filter") else [False])
def test_the_source_extracts_with_and_without_tarfiles_data_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, has_filter: bool
) -> None:
    """Debian 12's Python 3.11.2 has no ``extractall(filter=)`` (a TypeError stopped the first
    build); there the members are written by hand, and a name that leaves the tree is refused either way."""
    if not has_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    good = _tar_of(tmp_path, {"a/b.txt": b"x", "run.sh": b"#!/bin/sh\n"})
    dest = tmp_path / "out"
    dest.mkdir()
    with tarfile.open(good) as tar:
        source._extract(tar, tar.getmembers(), dest)
    assert (dest / "a" / "b.txt").read_bytes() == b"x"
    assert (dest / "run.sh").stat().st_mode & 0o7777 == 0o755  # no setuid bit, whatever the archive says
    evil = _tar_of(tmp_path, {"../escaped.txt": b"x"})
    with tarfile.open(evil) as tar, pytest.raises((BuildError, tarfile.TarError)):
        source._extract(tar, tar.getmembers(), dest)
    assert not (tmp_path / "escaped.txt").exists()


def test_a_cuda_toolkit_off_path_is_found_and_a_gpu_without_one_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVIDIA's installers leave /usr/local/cuda/bin off PATH and the build went CPU without a word.
    The toolkit is looked for where toolkits live; a GPU with none is one line that names the next step. (The GPU
    itself is the boundary we cannot reach here: ``gpu_visible`` is stubbed; the device run shows the real one.)"""
    home = tmp_path / "cuda-12.4"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho nvcc\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    for var in ("CUDACXX", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hw, "CUDA_HOMES", (str(tmp_path / "none"),))
    monkeypatch.setattr(hw, "CUDA_VERSIONED", tmp_path / "versioned")  # none of this machine's /usr/local/cuda-X.Y
    assert hw.find_nvcc() is None
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert hw.find_nvcc() == nvcc
    monkeypatch.setattr(hw, "gpu_visible", lambda: True)
    assert hw.detect_backend() == "cuda"
    flags = hw.backend_flags("cuda")
    assert f"-DCMAKE_CUDA_COMPILER={nvcc}" in flags
    assert str(home / "bin") in b._build_env(tmp_path).get("PATH", "").split(":")[0]
    monkeypatch.delenv("CUDA_HOME")
    said: list[str] = []
    assert hw.detect_backend(said.append) == "cpu"
    assert len(said) == 1 and "no CUDA toolkit" in said[0] and "apt-get install nvidia-cuda-toolkit" in said[0]
    with pytest.raises(BuildError, match="needs the CUDA toolkit"):
        hw.check_toolchain("cuda")


def test_the_vulkan_flavour_names_its_packages_when_they_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """--backend vulkan (AMD and Intel GPUs without ROCm): its cmake flag, and one line naming the
    packages when its headers or shader compiler are missing."""
    assert "-DGGML_VULKAN=ON" in hw.backend_flags("vulkan") and "vulkan" in hw.BACKENDS
    real_which = b.shutil.which
    monkeypatch.setattr(hw.shutil, "which", lambda c: None if c == "glslc" else real_which(c))
    with pytest.raises(BuildError, match="apt-get install libvulkan-dev spirv-headers glslc"):
        hw.check_toolchain("vulkan")
    # headers too old for the pinned llama.cpp (Debian 12's 1.3.239: a compile error deep in ggml-vulkan before)
    monkeypatch.setattr(hw.shutil, "which", lambda c: "/usr/bin/" + c)
    monkeypatch.setattr(hw, "SPIRV_CMAKE_DIRS", ("/",))
    monkeypatch.setattr(hw.Path, "is_dir", lambda self: True)
    monkeypatch.setattr(hw.Path, "is_file", lambda self: True)
    monkeypatch.setattr(hw, "_read", lambda p: "#define VK_HEADER_VERSION 239\n")
    with pytest.raises(BuildError, match=r"older than llama\.cpp"):
        hw.check_toolchain("vulkan")
    monkeypatch.setattr(hw, "_read", lambda p: "#define VK_EXT_layer_settings 1\n")
    hw.check_toolchain("vulkan")  # all there: no complaint
