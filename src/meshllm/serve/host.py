"""The llama-server this node runs when it hosts a model (solo, or the host of a split), under supervision.

Restarts with backoff when it dies; five deaths within a minute mark it failed (and say so) rather than loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshllm.llama.build import Binaries, cpu_flags
from meshllm.llama.processes import (
    Child,
    ChildFailed,
    describe_exit,
    explain_crash,
    free_port,
    llama_server_argv,
    uses_amx,
    wait_http_ready,
)

log = logging.getLogger("meshllm.host")

BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
CRASH_WINDOW_S = 60.0
MAX_CRASHES = 5


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    alias: str
    ctx_size: int
    threads: int
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[int, ...] = ()
    extra: tuple[str, ...] = ()
    draft: Path | None = None
    draft_max: int = 8


@dataclass
class LocalServer:
    bins: Binaries
    cfg: ServerConfig
    log_dir: Path
    state: str = "stopped"  # loading | serving | failed | stopped
    port: int = 0
    reason: str = ""
    restarts: int = 0
    _child: Child | None = None
    _task: asyncio.Task[None] | None = None
    _crashes: list[float] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._supervise())

    async def _launch(self) -> None:
        self.port = free_port()
        argv = llama_server_argv(
            self.bins, self.cfg.model, self.port, ctx_size=self.cfg.ctx_size, threads=self.cfg.threads,
            alias=self.cfg.alias, rpc=self.cfg.rpc, tensor_split=[float(x) for x in self.cfg.tensor_split],
            n_gpu_layers=999 if self.cfg.rpc else None, extra=self.cfg.extra, draft=self.cfg.draft,
            draft_max=self.cfg.draft_max,
        )  # fmt: skip
        self.state = "loading"
        self._child = Child.start("llama-server", argv, self.log_dir / "llama-server.log")
        await asyncio.to_thread(wait_http_ready, self._child, f"{self.base_url}/health", 600.0)
        self.state = "serving"
        self.reason = ""

    async def _supervise(self) -> None:
        while True:
            try:
                await self._launch()
                assert self._child is not None
                log.info("llama-server ready on 127.0.0.1:%d (pid %d)", self.port, self._child.pid)
                while self._child.alive():
                    await asyncio.sleep(0.5)
            except ChildFailed:
                pass
            child, self._child = self._child, None
            assert child is not None
            rc = child.proc.poll()
            how = "stopped answering" if rc is None else f"exited ({describe_exit(rc)})"
            if rc is None:
                await asyncio.to_thread(child.stop, 5.0)
            now = time.monotonic()
            self._crashes = [t for t in self._crashes if now - t < CRASH_WINDOW_S] + [now]
            if len(self._crashes) >= MAX_CRASHES:
                amx = uses_amx(self.bins.llama_server, cpu_flags())
                cause = explain_crash(rc, child.log_tail(400), amx)
                self.state = "failed"
                self.reason = (
                    f"llama-server {how} {len(self._crashes)} times in a minute; gave up. Likely cause: {cause} "
                    f"(log: {child.log_path})"
                )
                log.error("%s", self.reason)
                return
            delay = BACKOFF_S[min(len(self._crashes) - 1, len(BACKOFF_S) - 1)]
            self.state, self.reason = "loading", f"llama-server {how}; restarting in {delay:.0f} s"
            log.warning("%s (log: %s)", self.reason, child.log_path)
            self.restarts += 1
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with_child = self._child
            self._child = None
            if with_child:
                await asyncio.to_thread(with_child.stop, 10.0)
        self.state = "stopped"


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)
