"""Real mesh-llm node processes for integration tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from meshllm.proto import crypto


class NodeProc:
    def __init__(
        self, tmp: Path, name: str, model: Path | None, *args: str, env: dict[str, str] | None = None,
        port: int | None = None, auto: bool = False, wrap: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        """``wrap``: a command the node runs under (e.g. prlimit with its options)."""
        self.state = tmp / name
        self.log_path = tmp / f"{name}.log"
        self.port = port or 0
        which = ["--model", str(model)] if model is not None else [] if auto else ["--client"]
        cmd = [sys.executable, "-m", "meshllm.cli", *which, "--state-dir", str(self.state),
               "--bind-host", "127.0.0.1", "--port", str(self.port or _free_port()), *args]  # fmt: skip
        self.port = int(cmd[cmd.index("--port") + 1])
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*wrap, *cmd], stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def status(self) -> dict[str, object]:
        try:
            d: dict[str, object] = json.loads((self.state / "status.json").read_text())
            return d
        except (OSError, ValueError):
            return {}

    def peers(self) -> set[str]:
        return {p["short"] for p in self.status().get("peers", [])}  # type: ignore[attr-defined, index]

    def short(self) -> str:
        return crypto.short((self.state / "key").read_bytes() and crypto.node_id(self.key()))

    def key(self) -> crypto.Ed25519PrivateKey:
        return crypto.key_from_bytes((self.state / "key").read_bytes())

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def text_of(self, log: str) -> str:
        """One of the node's logs in its state dir (a child's), or "" before it exists."""
        p = self.state / log
        return p.read_text(errors="replace") if p.exists() else ""

    def kill_child(self, name: str) -> int:
        """SIGKILL the node's child process named ``name``; its pid."""
        for p in children(self.proc):
            if name in p.name():
                p.kill()
                return int(p.pid)
        raise AssertionError(f"no {name} under {self.state.name}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal mesh-llm itself (it must stop its own children); the process group only as a fallback."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leave nothing behind for the next test
        self.log.close()


def wait_for(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - t0


def _free_port() -> int:
    from meshllm.llama.processes import free_port

    return free_port()


def children(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def split_pair(tmp: Path, model: Path, nodes: list[NodeProc], *host_args: str) -> tuple[NodeProc, NodeProc]:
    """A host (0.446 GB: 9 of the tiny model's 18 layers beside the output, and too little for a second slot) and a
    worker (0.3 GB) serving a 2-node split of the tiny model; both go into ``nodes`` (the caller stops them)."""
    a = NodeProc(tmp, "a", model, "--max-vram", "0.446", "--ctx-size", "1024", *host_args)
    nodes.append(a)
    wait_for(lambda: (a.state / "token").exists(), 30, "a's token")
    b = NodeProc(tmp, "b", model, "--max-vram", "0.3", "--ctx-size", "1024", "--join",
                 (a.state / "token").read_text().strip())  # fmt: skip
    nodes.append(b)

    wait_for(lambda: serves(a, 2), 120, "a to serve a split with b")
    return a, b


def serves(n: NodeProc, assignments: int) -> bool:
    """``n`` hosts a plan of that many nodes and its llama-server serves that plan now. ("ready:" in its output and
    the plan in its status are not enough: a node that served alone first said it, and a new plan shows while the
    llama-server it replaces still answers, then while the new one loads: a 503.)"""
    st = n.status()
    plan = st.get("plan")
    return isinstance(plan, dict) and len(plan.get("assignments", [])) == assignments and st.get("plan_served") is True


@contextlib.contextmanager
def in_process_source(key: crypto.Ed25519PrivateKey, state: Path, token: object, sharing: object, facts: object,
                      name: str) -> Iterator[None]:  # fmt: skip
    """A member of our own code (not mesh-llm's node), over real QUIC, in a thread: it joins with ``token``, answers
    fetches with ``sharing`` (a ``serve.sharing.Sharing``, or one that lies) and says it serves the model ``facts``
    as a worker called ``name``; it leaves when the block ends."""
    import asyncio
    import threading

    from meshllm.net.conn import STREAM_FETCH
    from meshllm.net.meshnet import MeshNet
    from meshllm.proto.record import NodeState, Role

    stop, ready = threading.Event(), threading.Event()

    async def run() -> None:
        net = MeshNet(key, None, state, bind=("127.0.0.1", 0))
        await net.start()
        try:
            await net.join(token)  # type: ignore[arg-type]
            net.stream_handlers[STREAM_FETCH] = sharing.on_stream  # type: ignore[attr-defined]
            net.update(role=Role.WORKER, capacity=0, model=facts, state=NodeState.READY, name=name)  # type: ignore[arg-type]
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)
        finally:
            await net.stop(leave=True)

    th = threading.Thread(target=lambda: asyncio.run(run()))
    th.start()
    try:
        assert ready.wait(30), f"{name} did not join"
        yield
    finally:
        stop.set()
        th.join(30)
