"""Run named shell steps in order, every one of them, and print a table of how long each took and how it ended.

python scripts/timed.py "name==command" ...

A failing step does not stop the ones after it (a red integration step must not hide what the security tests or
the NAT lab would say); the exit status is the first failing step's, or 0 when all passed.
"""

from __future__ import annotations

import subprocess
import sys
import time


def main(steps: list[str]) -> int:
    rows: list[tuple[str, float, int]] = []
    for step in steps:
        name, _, cmd = step.partition("==")
        print(f"\n=== {name}: {cmd}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, shell=True).returncode
        rows.append((name, time.monotonic() - t0, rc))
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'}", flush=True)
    failed = [r for r in rows if r[2] != 0]
    print("\n| step | seconds | result |\n|---|---:|---|")
    for name, secs, code in rows:
        print(f"| {name} | {secs:.0f} | {'ok' if code == 0 else f'FAILED ({code})'} |")
    verdict = "ok" if not failed else f"FAILED: {', '.join(r[0] for r in failed)}"
    print(f"| total | {sum(r[1] for r in rows):.0f} | {verdict} |", flush=True)
    return failed[0][2] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
