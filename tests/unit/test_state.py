"""The state dir ([house]): one module names its files; each is written atomically with its mode from the start,
and secrets that others can read are refused on load."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from meshllm import state as s
from meshllm.errors import UserError
from meshllm.proto import crypto


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_every_file_is_private_from_the_start(tmp_path: Path) -> None:
    d = tmp_path / "node"
    key = s.load_or_create_key(d)
    s.save_membership(d, s.Membership(b"m" * 16, b"s" * 32, [(b"m" * 16, crypto.node_id(key), b"", 0, 2, b"")]))
    s.save_token(d, "TOKEN")
    s.save_api_key(d, "KEY")
    s.save_addrs(d, ["127.0.0.1:7000"])
    s.save_status(d, "{}")
    assert mode(d) == 0o700
    names = sorted(p.name for p in d.iterdir())
    assert names == ["api-key", "key", "mesh.json", "node.json", "status.json", "token"]  # no temporary left
    assert all(mode(d / n) == 0o600 for n in names)
    assert s.load_token(d) == "TOKEN" and s.load_addrs(d) == ["127.0.0.1:7000"] and s.has_node(d)


def test_secrets_others_can_read_are_refused(tmp_path: Path) -> None:
    key = s.load_or_create_key(tmp_path)
    s.save_membership(tmp_path, s.Membership(b"m" * 16, b"s" * 32, [(b"m" * 16, crypto.node_id(key), b"", 0, 2, b"")]))
    for name, load in [("key", s.load_or_create_key), ("mesh.json", s.load_membership)]:
        (tmp_path / name).chmod(0o644)
        with pytest.raises(UserError, match=f"{name} is readable by others"):
            load(tmp_path)
        (tmp_path / name).chmod(0o600)
        load(tmp_path)


def test_missing_or_damaged_addresses_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="start the node once first"):
        s.load_addrs(tmp_path)
    (tmp_path / "node.json").write_text('{"addrs": "not a list"}')
    with pytest.raises(UserError, match="damaged"):
        s.load_addrs(tmp_path)
    assert s.load_token(tmp_path) is None and not s.has_node(tmp_path)
