"""[reach] Cells of the NAT lab that work today: a node behind a NAT joins a public member directly.

(Hole punching between two NATed nodes and relays are the rest of the [reach] issue.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .lab import Lab, why_not

REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def lab() -> Iterator[Lab]:
    lb = Lab()
    try:
        yield lb.up("cone", "cone")
    finally:
        lb.down()


def _node(lab: Lab, where: str, state: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "meshllm.cli", "--client" if "--join" in args else "--model", *args,
            "--state-dir", str(state), "--port", "9337"]  # fmt: skip
    return subprocess.Popen(lab.exec_argv(where, argv), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ}, start_new_session=True)  # fmt: skip


def _peers(state: Path) -> list[dict[str, object]]:
    try:
        return list(json.loads((state / "status.json").read_text())["peers"])
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.parametrize("mode", ["cone", "random", "cone+fw"])
def test_a_node_behind_a_nat_joins_a_public_member_directly(
    lab: Lab, mode: str, tmp_path: Path, tiny_model: Path
) -> None:
    lab.set_nat("natA", mode)
    r_state, a_state = tmp_path / "rdv", tmp_path / "a"
    procs = [_node(lab, "rdv", r_state, tmp_path / "rdv.log", str(tiny_model), "--bind-host", "198.51.100.10",
                   "--bind-port", "7000")]  # fmt: skip
    try:
        t0 = time.monotonic()
        while not (r_state / "token").exists():
            assert time.monotonic() - t0 < 30, (tmp_path / "rdv.log").read_text()
            time.sleep(0.2)
        token = (r_state / "token").read_text().strip()
        procs.append(_node(lab, "homeA", a_state, tmp_path / "a.log", "--join", token))
        t0 = time.monotonic()
        while len(_peers(a_state)) < 2 or len(_peers(r_state)) < 2:
            assert time.monotonic() - t0 < 30, (tmp_path / "a.log").read_text()[-2000:]
            time.sleep(0.2)
        ttfb = time.monotonic() - t0
        seen = next(p for p in _peers(r_state) if p["path"] != "self")
        # the public member sees the NAT's public address, not the home's private one
        assert str(seen["path"]).startswith("direct 198.51.100.2:"), seen
        print(f"{mode}: joined through the NAT in {ttfb:.1f} s, seen as {seen['path']}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
