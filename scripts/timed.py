"""Run named shell steps in order, stop at the first failure, and print a table of how long each took.

python scripts/timed.py "name==command" ...
"""

from __future__ import annotations

import subprocess
import sys
import time


def main(steps: list[str]) -> int:
    rows: list[tuple[str, float, int]] = []
    rc = 0
    for step in steps:
        name, _, cmd = step.partition("==")
        print(f"\n=== {name}: {cmd}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, shell=True).returncode
        rows.append((name, time.monotonic() - t0, rc))
        if rc != 0:
            break
    print("\n| step | seconds | result |\n|---|---:|---|")
    for name, secs, code in rows:
        print(f"| {name} | {secs:.0f} | {'ok' if code == 0 else f'FAILED ({code})'} |")
    print(f"| total | {sum(r[1] for r in rows):.0f} | {'ok' if rc == 0 else 'FAILED'} |", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
