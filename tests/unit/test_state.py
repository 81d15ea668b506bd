"""The state dir: one module names its files; each is written atomically with its mode from the start,
and secrets that others can read are refused on load."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from meshllm.errors import UserError
from meshllm.machine import state as s
from meshllm.proto import crypto


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_every_file_is_private_from_the_start(tmp_path: Path) -> None:
    d = tmp_path / "node"
    key = s.load_or_create_key(d)
    s.save_membership(d, s.Membership(b"m" * 16, b"s" * 32, [(b"m" * 16, crypto.node_id(key), b"", 0, 0, 2, b"", ())]))
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
    link = (b"m" * 16, crypto.node_id(key), b"", 0, 0, 2, b"", ())
    s.save_membership(tmp_path, s.Membership(b"m" * 16, b"s" * 32, [link]))
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


def test_a_planted_file_or_link_is_never_written_through_and_an_open_dir_is_closed(tmp_path: Path) -> None:
    """Low findings: a file planted at the temporary name left `token` world-writable; a 0777 state dir was
    kept as is."""
    import os

    d = tmp_path / "node"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    tmp = d / f".token.{os.getpid()}.tmp"
    tmp.symlink_to(victim)  # a link planted where the temporary file goes
    s.save_token(d, "TOKEN")
    assert victim.read_text() == "untouched" and mode(d / "token") == 0o600 and s.load_token(d) == "TOKEN"
    assert mode(d) == 0o700
    planted = d / f".token.{os.getpid()}.tmp"
    planted.write_text("x")
    planted.chmod(0o666)  # a world-writable file planted there: replaced by a new 0600 one
    s.save_token(d, "TOKEN2")
    assert mode(d / "token") == 0o600 and s.load_token(d) == "TOKEN2" and not planted.exists()


def test_a_shared_folder_is_refused_not_closed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: closing it would break everyone else's use of it
    with pytest.raises(UserError, match="others can write to"):
        s.save_token(shared, "TOKEN")
    assert mode(shared) == 0o1777


def test_serve_and_drop_sign_words_in_the_founders_state_dir(tmp_path: Path, capsys: object) -> None:
    """`mesh-llm drop NAME` / `serve NAME` on the founder's state dir: each a signed word kept in
    `directives`, the newer one at least a second later than the last about that model (same second: it still
    counts), a word the running node kept from an admin revoked since left out rather than a traceback; a member
    that is neither founder nor admin gets one line."""
    import time

    from meshllm.cli.main import main
    from meshllm.machine import state as s
    from meshllm.proto import admission as adm
    from meshllm.proto import crypto
    from meshllm.proto import signed as sgn

    sd = tmp_path / "founder"
    sd.mkdir(mode=0o700)
    key = s.load_or_create_key(sd)
    chain = adm.found(key, time.time())
    s.save_membership(sd, s.Membership(chain[0][0], b"\0" * 32, chain))
    mid = chain[0][0]
    stranger = crypto.new_key()  # signs as if an admin: its word is in the file, but no grant makes it one
    forged = sgn.direct(stranger, mid, "z", False, time.time(), admins={crypto.node_id(stranger)})
    s.save_directives(sd, [forged])
    assert main(["drop", "m", "--state-dir", str(sd)]) == 0
    dropped = [sgn.directive_from_wire(o, mid) for o in s.load_directives(sd)]
    assert [(w.model, w.serve) for w in dropped] == [("m", False)]  # the forged word is left out
    assert main(["serve", "m", "--state-dir", str(sd)]) == 0
    words = [sgn.directive_from_wire(o, mid) for o in s.load_directives(sd)]
    assert [(w.model, w.serve) for w in words] == [("m", True)] and words[0].by == crypto.node_id(key)
    assert words[0].newer(dropped[0]) and words[0].at > dropped[0].at  # the same second: a drop would win a tie
    assert "serve m: the running node gossips it" in capsys.readouterr().out  # type: ignore[attr-defined]
    member = tmp_path / "member"
    member.mkdir(mode=0o700)
    mk = s.load_or_create_key(member)
    s.save_membership(member, s.Membership(mid, b"\0" * 32, adm.admit(key, chain, crypto.node_id(mk), time.time())))
    assert main(["drop", "m", "--state-dir", str(member)]) != 0
    assert "only the node that founded the mesh, or an admin" in capsys.readouterr().err  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["revoked", "admins", "directives"])
def test_the_signed_words_files_must_be_private(tmp_path: Path, name: str) -> None:
    """(the mutation audit left it untested): ``revoked``, ``admins`` and ``directives`` are read only
    when no one else may read or write them; one with another mode is a clear error, not trusted."""
    from meshllm.machine.state import load_directives, load_signed

    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    path = state / name
    path.write_text("[]\n")
    path.chmod(0o600)
    load = (lambda: load_directives(state)) if name == "directives" else (lambda: load_signed(state, name))
    assert load() == []
    path.chmod(0o644)
    with pytest.raises(UserError, match="readable by others"):
        load()
