"""Fetching a model from peers next to a plain TCP copy of the same file between the same two endpoints.

    .venv/bin/python benchmarks/fetch.py [--runs 3] [--sources 1,2] [--link 1gbit]

Rows, all in one run, on this machine's loopback (the tiny model, ~250 MB) — or, with ``--link RATE`` (root), on
the loopback of a network namespace of its own shaped to RATE by the kernel's token bucket filter (``tc qdisc ...
tbf``; this kernel has no netem), as a LAN link would be:
  plain TCP copy        one socket, the kernel's sendfile on one side, recv_into + write on the other, to disk
  mesh-llm fetch        a node joining with --model NAME and no file fetches it from N members (QUIC streams,
                        chunks of at most 8 MiB following the file's layout (--fetch all), each checked against
                        the source's signed manifest, the whole file's SHA-256
                        and fingerprint checked at the end); its own "fetched … in X s (Y s with the manifests"
                        line, two rows: from its manifest requests (the sources hash the whole file then, as the
                        plain copy's clock covers everything) and from its first chunk, each to the checked file
Each row: the median MB/s of --runs runs, and its ratio to the plain copy.

    .venv/bin/python benchmarks/fetch.py --split 4

A mesh of N nodes that all start at once with ``--model org/repo/file.gguf`` and no file, the hub being a local
stand-in (tests/fakes/hub_standin.py) that counts the bytes it sends: the founder downloads the model from it, the
others join and fetch only the layers the plan gives them from the founder (--max-vram makes the plan split the
tiny model N-1 ways over the workers; the host keeps the embedding and the output). Rows: each node's layers, its
disk use (allocated blocks of its models dir) next to its layers' bytes + the header, and the hub's bytes in all
next to the model's size.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import header  # benchmarks/common.py: the command line and machine
from loadgen import wait_until

ROOT = Path(__file__).resolve().parents[1]


def tcp_copy(src: Path, dest: Path) -> float:
    """Seconds to copy ``src`` to ``dest`` over one loopback TCP connection."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def send() -> None:
        conn, _ = srv.accept()
        with conn, src.open("rb") as f:
            conn.sendfile(f)

    t = threading.Thread(target=send)
    t.start()
    t0 = time.monotonic()
    buf = bytearray(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as c, dest.open("wb") as out:
        while n := c.recv_into(buf):
            out.write(memoryview(buf)[:n])
    took = time.monotonic() - t0
    t.join()
    srv.close()
    return took


def shaped(args: argparse.Namespace) -> None:
    """This benchmark again, inside a network namespace whose loopback the kernel shapes to ``args.link``."""
    ns = f"meshfetch{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        run_in = ["ip", "netns", "exec", ns]
        subprocess.run([*run_in, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run([*run_in, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.link, "burst",
                        "256kb", "latency", "50ms"], check=True)  # fmt: skip
        env = {**os.environ, "MESH_FETCH_LINK": f"loopback shaped to {args.link} (tc tbf) in a netns"}
        subprocess.run([*run_in, sys.executable, __file__, "--runs", str(args.runs), "--sources", args.sources],
                       check=True, env=env)  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sources", default="1,2", help="members that have the file, for each mesh row")
    ap.add_argument("--link", help="run on a loopback shaped to this rate (tc's units: 1gbit), in a netns (root)")
    ap.add_argument("--split", type=int, metavar="N", help="hub bytes and worker disk for an N-node split (N >= 2)")
    args = ap.parse_args()
    header()
    if args.split:
        split_from_nothing(args.split)
        return
    if args.link:
        shaped(args)
        return
    sys.path.insert(0, str(ROOT / "src"))
    from meshllm.llama.processes import free_port
    from meshllm.models.tiny import tiny_model_path

    model = tiny_model_path()
    size = model.stat().st_size
    tmp = Path(tempfile.mkdtemp(prefix="mesh-fetch-"))
    rows: list[tuple[str, list[float]]] = []
    procs: list[subprocess.Popen[bytes]] = []

    def node(name: str, *extra: str) -> Path:
        log = tmp / f"{name}.log"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "meshllm.cli", "--state-dir", str(tmp / name), "--bind-host", "127.0.0.1",
             "--port", str(free_port()), "--ctx-size", "512", *extra],
            stdout=log.open("wb"), stderr=subprocess.STDOUT))  # fmt: skip
        return log

    def one_fetch(run: int, n_src: int) -> tuple[float, float]:
        """Seconds a joining node took to fetch the model from ``n_src`` members (its own line): from its first
        chunk, and from its manifest requests (the sources hash the file then: the start the plain copy has)."""
        for p in procs:
            p.terminate()
            p.wait(30)
        procs.clear()
        first = node(f"s{run}-0", "--model", str(model), "--max-vram", "1.5")  # the host: the most memory
        token_file = tmp / f"s{run}-0" / "token"
        wait_until(token_file.exists, 60, "the first source's token")
        token = token_file.read_text().strip()
        for i in range(1, n_src):
            node(f"s{run}-{i}", "--model", str(model), "--max-vram", "1", "--join", token)
        try:
            wait_until(lambda: "ready:" in first.read_text(errors="replace"), 120, "the mesh")
        except SystemExit:
            raise SystemExit(first.read_text(errors="replace")[-1500:]) from None
        time.sleep(2)
        log = node(f"f{run}", "--model", model.stem, "--fetch", "all", "--models-dir", str(tmp / f"m{run}"),
                   "--max-vram", "0.2", "--join", token)  # fmt: skip
        wait_until(lambda: re.search(r"fetched |error", log.read_text(errors="replace")), 300, "the fetch")
        m = re.search(r"from the mesh in ([\d.]+) s \(([\d.]+) s with the manifests", log.read_text())
        if m is None:
            raise SystemExit(log.read_text()[-2000:])
        shutil.rmtree(tmp / f"m{run}", ignore_errors=True)
        return float(m[1]), float(m[2])

    try:
        rows.append(("plain TCP copy", [size / tcp_copy(model, tmp / f"copy{i}") / 1e6
                                                    for i in range(args.runs)]))  # fmt: skip
        for n_src in [int(x) for x in args.sources.split(",")]:
            times = [one_fetch(run, n_src) for run in range(args.runs)]
            whom = f"{n_src} member{'s' if n_src > 1 else ''}"
            rows.append((f"mesh-llm fetch from {whom}: from the manifest requests", [size / t / 1e6 for _, t in times]))
            rows.append((f"mesh-llm fetch from {whom}: chunks only", [size / t / 1e6 for t, _ in times]))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(rows[0][1])
    where = os.environ.get("MESH_FETCH_LINK", "this machine's loopback")
    print(f"\n# {where} ({os.cpu_count()} cores), the tiny model ({size / 1e6:.0f} MB); median of {args.runs} runs")
    print("| path | MB/s | ÷ plain TCP copy |")
    print("|---|---:|---:|")
    for name, speeds in rows:
        print(f"| {name} | {statistics.median(speeds):.0f} | {statistics.median(speeds) / base:.2f} |")


def split_from_nothing(n: int) -> None:
    """``--split N``: see the module's docstring."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "src"))
    from tests.fakes.hub_standin import HubFile, HubStandin

    from meshllm.llama.gguf import held_with_layer, read_header
    from meshllm.llama.processes import free_port
    from meshllm.models.tiny import tiny_model_path

    model = tiny_model_path()
    hdr = read_header(model)
    hub = HubStandin()
    hub.files["someorg/tiny/tiny.gguf"] = HubFile(model.read_bytes())
    hub.start()
    tmp = Path(tempfile.mkdtemp(prefix="mesh-split-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    ports = [free_port() for _ in range(n)]

    def node(i: int, *extra: str) -> Path:
        log = tmp / f"n{i}.log"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "meshllm.cli", "--state-dir", str(tmp / f"n{i}"), "--bind-host", "127.0.0.1",
             "--port", str(ports[i]), "--ctx-size", "512", "--parallel", "1", "--model", "someorg/tiny/tiny.gguf",
             "--models-dir", str(tmp / f"m{i}"), *extra],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env))  # fmt: skip
        return log

    def status(i: int) -> dict[str, object]:
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{ports[i]}/mesh/status", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    try:
        host_log = node(0, "--max-vram", "0.41")
        wait_until((tmp / "n0" / "token").exists, 60, "the founder's token")
        token = (tmp / "n0" / "token").read_text().strip()
        for i in range(1, n):  # at once, as the founder downloads
            node(i, "--max-vram", f"{0.165 / (n - 1):.3f}", "--join", token)

        def serving() -> bool:
            plan = status(0).get("plan") if "ready:" in host_log.read_text(errors="replace") else None
            return isinstance(plan, dict) and len(plan.get("assignments", [])) == n

        try:
            wait_until(serving, 300, f"an {n}-node split")
        except SystemExit:
            raise SystemExit("\n".join(p.read_text(errors="replace")[-1500:] for p in tmp.glob("n*.log"))) from None
        plan = status(0)["plan"]
        assert isinstance(plan, dict)
        ids = [str(status(i)["node"]) for i in range(n)]
        rows = []
        for i in range(n):
            a = next(x for x in plan["assignments"] if x["node"] == ids[i])
            layers = range(int(a["first"]), int(a["first"]) + int(a["count"]))
            used = sum(p.stat().st_blocks * 512 for p in (tmp / f"m{i}").rglob("*") if p.is_file())
            need = hdr.data_offset + sum(t.nbytes for t in hdr.tensors if held_with_layer(t.name) in layers)
            what = "host (the whole file: it may host)" if i == 0 else "worker"
            span = f"{layers.start}-{layers.stop - 1}" if len(layers) else "- (+ output)"
            got = re.findall(r"fetched layers (.+?) of", (tmp / f"n{i}.log").read_text(errors="replace"))
            rows.append((f"n{i} {what}", span + (f" (fetched {', '.join(got)})" if got else ""), used, need))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        hub.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    size = model.stat().st_size
    print(f"\n# {n} nodes on this machine's loopback ({os.cpu_count()} cores), the tiny model ({size / 1e6:.1f} MB), "
          "none with the file at start; hub = a local stand-in")  # fmt: skip
    print("| node | layers | disk MB | its layers (layer 0: + the token embedding) + header MB | ÷ |")
    print("|---|---|---:|---:|---:|")
    for name, span, used, need in rows:
        ratio = f"{used / need:.3f}" if "worker" in name else "-"
        print(f"| {name} | {span} | {used / 1e6:.1f} | {need / 1e6:.1f} | {ratio} |")
    print(f"| hub: bytes sent in all | | {hub.sent / 1e6:.1f} | model {size / 1e6:.1f} | {hub.sent / size:.3f} |")


if __name__ == "__main__":
    main()
