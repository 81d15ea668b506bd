"""The config file — every flag of the node as a TOML key, per-model tables, flags win, and a bad key
or value is one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.cli.main import _parse_with_config, build_parser
from meshllm.errors import UserError
from meshllm.machine import config

GOOD = """
model = "m.gguf"
port = 9444
max-vram = 2.5
no_draft = true
split-replicas = false
join-file = ["~/t1", "/tmp/t2"]
console = true

[models."m.gguf"]
ctx-size = 2048
parallel = 3

[models."other.gguf"]
ctx-size = 8192
"""


def _write(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_every_key_is_a_flag_and_flags_win(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    args = _parse_with_config(build_parser(), ["--config", str(path), "--port", "9555"])
    assert args.port == 9555  # the flag wins
    assert (args.max_vram, args.no_draft, args.split_replicas, args.console) == (2.5, True, False, 3131)
    assert args.join_file == [str(Path("~/t1").expanduser()), "/tmp/t2"]
    assert str(args.model) == "m.gguf" and (args.ctx_size, args.parallel) == (2048, 3)  # its model's table
    other = _parse_with_config(build_parser(), ["--config", str(path), "--model", "other.gguf", "--parallel", "1"])
    assert (other.ctx_size, other.parallel, other.port) == (8192, 1, 9444)
    plain = _parse_with_config(build_parser(), ["--model", "x.gguf"])  # no file: nothing changes
    assert plain.port == 9337


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("colour = 'blue'\n", "unknown key 'colour'"),
        ("[ctx]\nsize = 3\n", "unknown key 'ctx'"),
        ("port = 70000\n", "--port"),
        ("no-draft = 'yes'\n", "no-draft takes true or false"),
        ("port = [1, 2]\n", "port takes one value, not a list"),
        ("max-tokens = true\n", "max-tokens takes a value"),
        ("port = \n", "not TOML"),
        ("help = true\n", "unknown key 'help'"),
        ("[models]\nx = 3\n", "one table per model name"),
        ("model = 'm.gguf'\n[models.'m.gguf']\nctx-sizes = 3\n", "unknown key 'ctx-sizes'"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_the_file(
    tmp_path: Path, text: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        _parse_with_config(build_parser(), ["--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and str(path) in err, err


def test_a_file_holding_a_secret_must_be_private(tmp_path: Path) -> None:
    path = _write(tmp_path, "join = ['mesh1.x']\n", 0o644)
    with pytest.raises(UserError, match="readable by others"):
        config.load(path)
    path.chmod(0o600)
    assert config.load(path) == {"join": ["mesh1.x"]}
    _write(tmp_path, "port = 9444\n", 0o644)  # nothing secret: any mode
    assert config.load(path) == {"port": 9444}


def test_the_default_file_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_LLM_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config.config_path([]) == (None, False)
    (tmp_path / "mesh-llm").mkdir()
    (tmp_path / "mesh-llm" / "config.toml").write_text("port = 9444\n")
    assert config.config_path([]) == (tmp_path / "mesh-llm" / "config.toml", False)
    assert _parse_with_config(build_parser(), []).port == 9444
    assert _parse_with_config(build_parser(), ["status"]).port == 9337  # a subcommand: not the node's file
    monkeypatch.setenv("MESH_LLM_CONFIG", str(tmp_path / "elsewhere.toml"))
    assert config.config_path([]) == (tmp_path / "elsewhere.toml", True)
