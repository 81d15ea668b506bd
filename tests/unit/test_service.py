"""The service unit — this mesh-llm with the node's flags, restarted on failure, started at boot;
never a token or a key on its command line; checked by systemd-analyze where systemd is installed."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

from meshllm.cli.main import main
from meshllm.errors import UserError
from meshllm.machine import service


def test_install_writes_a_unit_systemd_accepts_and_remove_takes_it_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["service", "install", "--unit", "mesh-a", "--model", "gemma3-270m", "--join-file", "/tmp/t t"]) == 0
    path = tmp_path / "systemd" / "user" / "mesh-a.service"
    assert str(path) in capsys.readouterr().out
    unit = configparser.ConfigParser(interpolation=None)
    unit.read_string(path.read_text())
    start = unit["Service"]["ExecStart"]
    assert start.endswith("--model gemma3-270m --join-file '/tmp/t t'") and "--unit" not in start
    assert Path(start.split()[0]).name in ("mesh-llm", "python", "python3")
    assert unit["Service"]["Restart"] == "on-failure" and unit["Install"]["WantedBy"] == "default.target"
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert main(["service", "remove", "--unit", "mesh-a"]) == 0 and not path.exists()
    assert main(["service", "remove", "--unit", "mesh-a"]) == 2  # one line: no such unit


@pytest.mark.parametrize("flags", [["--join", "mesh1.x"], ["--join=mesh1.x"], ["--api-key", "k"], ["status"]])
def test_no_token_or_key_goes_into_a_unit(flags: list[str]) -> None:
    with pytest.raises(UserError):
        service.unit_text("/usr/bin/mesh-llm", flags)
