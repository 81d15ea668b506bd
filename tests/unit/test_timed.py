"""`just test`'s step runner: a red step is reported and the steps after it still run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[2] / "scripts" / "timed.py"


def test_every_step_runs_and_the_first_failure_is_the_exit_status(tmp_path: Path) -> None:
    marks = tmp_path / "ran"
    steps = [f"one==echo one >> {marks}", f"two==echo two >> {marks}; exit 3", f"three==echo three >> {marks}; exit 4",
             f"four==echo four >> {marks}"]  # fmt: skip
    r = subprocess.run([sys.executable, str(RUNNER), *steps], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stdout
    assert marks.read_text().split() == ["one", "two", "three", "four"]
    table = r.stdout[r.stdout.index("| step |"):]
    assert "| one |" in table and "| two |" in table and "FAILED (3)" in table and "FAILED (4)" in table
    assert "| four |" in table and table.strip().splitlines()[-1].endswith("| FAILED: two, three |")


def test_all_green_exits_0(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(RUNNER), "a==true", "b==true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].endswith("| ok |"), r.stdout
