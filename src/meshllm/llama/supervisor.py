"""The llama.cpp children a node runs — llama-server when it hosts, ggml-rpc-server when it has the model — kept
running the same way: started, awaited until ready, restarted with backoff when they die. Five deaths within a
minute mark a child failed, with one line that gives the likely cause and the fix (:func:`explain_crash`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import aiohttp

from meshllm.delaytcp import DelayProxy
from meshllm.llama.build import Binaries
from meshllm.llama.chat import ChatDefault
from meshllm.llama.hardware import cpu_flags
from meshllm.llama.processes import (
    ANY_ADDR,
    LOOPBACK,
    Child,
    ChildFailed,
    Tuning,
    describe_exit,
    explain_crash,
    free_port,
    llama_server_argv,
    rpc_server_argv,
    speaks_peers,
    speaks_tls,
    uses_amx,
    wait_http_ready,
    wait_tcp_ready,
)
from meshllm.paths import write_private
from meshllm.sockets import host_port

log = logging.getLogger("meshllm.supervisor")

BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
CRASH_WINDOW_S = 60.0
MAX_CRASHES = 5
EMBD_BATCH_MAX = 8192  # an embedding model's longest input (one batch: its compute buffer grows with it)


class ChildState(StrEnum):
    LOADING = "loading"  # starting, or restarting after a crash
    SERVING = "serving"
    FAILED = "failed"  # gave up after MAX_CRASHES in CRASH_WINDOW_S
    STOPPED = "stopped"


def default_threads() -> int:
    """The CPUs this process may run on (a cpuset, ``taskset``, a container's limit), not the machine's count: one
    thread per CPU it cannot use only waits for the others."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


class Supervised:
    """One child process under supervision. ``argv(port)`` builds its command line for a port; ``ready(child, port)``
    blocks until it serves (raising ChildFailed if it dies or times out). ``fixed_port``: restart on the same port
    (an rpc-server others already point at); None: a fresh loopback port at every start."""

    def __init__(
        self,
        name: str,
        binary: Path,
        argv: Callable[[int], list[str]],
        ready: Callable[[Child, int], None],
        log_path: Path,
        fixed_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        # added to ours (secrets go in files, never here). GGML_NO_BACKTRACE: on an abort ggml would otherwise attach
        # gdb to print a backtrace, which can hang the dying child (seen here) and delays every restart
        self._env = {**os.environ, "GGML_NO_BACKTRACE": "1", **(env or {})}
        # whenever the child dies (not when we stop it): how ("exited (SIGKILL)", "stopped answering"), its log's tail
        self.on_exit: Callable[[str, str], None] | None = None
        self.binary = binary
        self._argv = argv
        self._ready = ready
        self.log_path = log_path
        self._fixed_port = fixed_port
        self.state = ChildState.STOPPED
        self.port = fixed_port or 0
        self.reason = ""
        self.restarts = 0
        self.child: Child | None = None
        self._task: asyncio.Task[None] | None = None
        self._crashes: list[float] = []
        self._first_ready = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._supervise())

    async def wait_ready(self) -> None:
        """Until the first start succeeded; ChildFailed if the child failed before ever getting ready."""
        done = asyncio.ensure_future(self._first_ready.wait())
        assert self._task is not None
        await asyncio.wait([done, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not self._first_ready.is_set():
            done.cancel()
            raise ChildFailed(self.reason or f"{self.name} stopped")

    def alive(self) -> bool:
        return self.state == ChildState.SERVING and self.child is not None and self.child.alive()

    async def _launch(self) -> None:
        self.port = self._fixed_port or free_port()
        self.state = ChildState.LOADING
        self.child = Child.start(self.name, self._argv(self.port), self.log_path, env=self._env)
        await asyncio.to_thread(self._ready, self.child, self.port)
        self.state = ChildState.SERVING
        self.reason = ""
        self._first_ready.set()

    async def _supervise(self) -> None:
        while True:
            try:
                await self._launch()
                assert self.child is not None
                log.info("%s ready on 127.0.0.1:%d (pid %d)", self.name, self.port, self.child.pid)
                while self.child.alive():
                    await asyncio.sleep(0.5)
            except ChildFailed:
                pass
            child, self.child = self.child, None
            assert child is not None
            rc = child.proc.poll()
            how = "stopped answering" if rc is None else f"exited ({describe_exit(rc)})"
            if self.on_exit is not None:
                self.on_exit(how, child.log_tail(400))
            if rc is None:
                await asyncio.to_thread(child.stop, 5.0)
            now = time.monotonic()
            self._crashes = [t for t in self._crashes if now - t < CRASH_WINDOW_S] + [now]
            if len(self._crashes) >= MAX_CRASHES:
                cause = explain_crash(rc, child.log_tail(400), uses_amx(self.binary, cpu_flags()))
                self.state = ChildState.FAILED
                self.reason = (
                    f"{self.name} {how} {len(self._crashes)} times in a minute; gave up. Likely cause: {cause} "
                    f"(log: {child.log_path})"
                )
                log.error("%s", self.reason)
                return
            delay = BACKOFF_S[min(len(self._crashes) - 1, len(BACKOFF_S) - 1)]
            self.state, self.reason = ChildState.LOADING, f"{self.name} {how}; restarting in {delay:.0f} s"
            log.warning("%s (log: %s)", self.reason, child.log_path)
            self.restarts += 1
            await asyncio.sleep(delay)

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self._task:
            self._task.cancel()
        child, self.child = self.child, None
        if child:
            await asyncio.to_thread(child.stop, grace_s)
        self.state = ChildState.STOPPED


# ------------------------------------------------------------------------------------------------ the two children


@dataclass(frozen=True)
class ServerConfig:
    """Everything llama-server's command line depends on: a change means a restart."""

    model: Path
    alias: str
    ctx_size: int  # each slot's
    threads: int
    parallel: int = 1  # slots
    tuning: Tuning = field(default_factory=Tuning)
    chat: ChatDefault | None = None  # the chat template for a model that has none of its own
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[int, ...] = ()
    extra: tuple[str, ...] = ()
    draft: Path | None = None
    draft_max: int = 8
    draft_device: str | None = None  # the host's own accelerator; None: the CPU
    tls_keys: Path | None = None  # the keys of the rpc endpoints reached directly (TLS), one file per generation
    peers: tuple[str, ...] = ()  # "ENDPOINT=IP:PORT": workers' listeners for their predecessor (patch 0011)
    embd_first: bool = False  # the token embedding on the first RPC server, with layer 0 (patch 0013)
    n_gpu_layers: int | None = None  # fewer than every unit: the first layers on this process's CPU
    embeddings: bool = False  # an embedding model: llama-server's embedding mode (/v1/embeddings)


class LocalServer(Supervised):
    """The llama-server this node runs when it hosts a model (solo, or the host of a split)."""

    def __init__(self, bins: Binaries, cfg: ServerConfig, log_dir: Path) -> None:
        env = {"LLAMA_SERVER_LOAD_PROGRESS": "1"}  # a line per progress step (patch 0007): load_progress()
        if cfg.tls_keys:
            env["GGML_RPC_TLS_CLIENT_KEYS"] = str(cfg.tls_keys)
        # patch 0013: the token embedding on the first worker where the plan has room for it there (that worker then
        # gets token ids, not embedding rows); LLAMA_INPUT_ON_FIRST_RPC=0 in our environment keeps it here (A/B)
        on_first = cfg.embd_first and os.environ.get("LLAMA_INPUT_ON_FIRST_RPC") != "0"
        env["LLAMA_INPUT_ON_FIRST_RPC"] = "1" if on_first else "0"
        if cfg.peers:  # worker to worker: llama-server links each pair of neighbours with a key it makes
            env["GGML_RPC_PEERS"] = ",".join(cfg.peers)
        # its loopback port answers nobody without this key (from a 0600 file, never a command line): another user of
        # the machine cannot go around mesh-llm's API (its key, its caps) to llama-server; only /health is open
        self.key = secrets.token_hex(32)
        key_file = log_dir / "llama-server.key"
        write_private(key_file, f"{self.key}\n".encode())

        def argv(port: int) -> list[str]:
            return llama_server_argv(
                bins, cfg.model, port, ctx_size=cfg.ctx_size, parallel=cfg.parallel, tuning=cfg.tuning,
                chat=cfg.chat, threads=cfg.threads, alias=cfg.alias, rpc=cfg.rpc,
                tensor_split=[float(x) for x in cfg.tensor_split],
                n_gpu_layers=cfg.n_gpu_layers or (999 if cfg.rpc else None),
                extra=(*cfg.extra, "--api-key-file", str(key_file)), draft=cfg.draft, draft_max=cfg.draft_max,
                draft_device=cfg.draft_device, embeddings=min(cfg.ctx_size, EMBD_BATCH_MAX) if cfg.embeddings else 0,
            )  # fmt: skip

        def ready(child: Child, port: int) -> None:
            wait_http_ready(child, f"http://127.0.0.1:{port}/health", 600.0)

        super().__init__("llama-server", bins.llama_server, argv, ready, log_dir / "llama-server.log", env=env)
        self.cfg = cfg

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def load_progress(self) -> int:
        """Percent of the model loaded while loading (from its log); -1 when not loading."""
        if self.state != ChildState.LOADING:
            return -1
        return load_progress(self.log_path)

    def log_tail(self) -> str:
        """Its current run's log (the last 64 KiB of it)."""
        return current_run(self.log_path) or ""

    async def generated(self, http: aiohttp.ClientSession) -> tuple[int, int, int] | None:
        """(tokens generated by finished requests, prompt tokens processed, tokens generated so far by the requests
        running now) since this llama-server started: its /metrics counts a request only when it ends, its /slots
        shows the running ones. Read in that order, a request that ends in between is in neither (counted a second
        later), never in both."""
        auth = {"Authorization": f"Bearer {self.key}"}
        try:
            async with http.get(f"{self.base_url}/metrics", headers=auth) as r:
                text = await r.text() if r.status == 200 else ""
            async with http.get(f"{self.base_url}/slots", headers=auth) as r:
                slots = await r.json(content_type=None) if r.status == 200 else []
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        values = dict(line.split()[:2] for line in text.splitlines() if line.startswith("llamacpp:") and " " in line)
        try:
            done, prompt = (int(float(values["llamacpp:tokens_predicted_total"])),
                            int(float(values["llamacpp:prompt_tokens_total"])))  # fmt: skip
        except (KeyError, ValueError):
            return None
        return done, prompt, running_tokens(slots)


def running_tokens(slots: object) -> int:
    """Tokens generated so far by the requests running now, from llama-server's /slots (0 for anything else)."""
    n = 0
    for slot in slots if isinstance(slots, list) else []:
        nxt = slot.get("next_token") if isinstance(slot, dict) and slot.get("is_processing") else None
        for t in nxt if isinstance(nxt, list) else []:
            d = t.get("n_decoded") if isinstance(t, dict) else None
            n += d if isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 31 else 0
    return n


def current_run(log_path: Path, tail: int = 1 << 16) -> str | None:
    """The last ``tail`` bytes of a child's log, from its current run's start on (each start writes its command line
    first: "$ argv"); None when the log cannot be read."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, log_path.stat().st_size - tail))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text[text.rfind("\n$ ") + 1 :]


def load_progress(log_path: Path, tail: int = 1 << 16) -> int:
    """The latest "load progress: STAGE P%" line of the current run in a llama-server log (patch 0007, asked for
    with LLAMA_SERVER_LOAD_PROGRESS), as a whole percent; 0 before the first, -1 when the log cannot be read."""
    run = current_run(log_path, tail)
    if run is None:
        return -1
    found = re.findall(r"(?m)^load progress: \S+ (\d+(?:\.\d+)?)%$", run)
    return min(100, int(float(found[-1]))) if found else 0


class RpcServer(Supervised):
    """This node's ggml-rpc-server, loading weights from its own copy of the model. It listens on loopback (for
    tunnels and the host's own use) and, when the build speaks TLS (patch 0005), on ``tls_port`` on every
    interface for the direct path: there only a client holding a key from ``keys_file`` gets past the handshake.
    With that, when the build has patch 0011, on ``peer_port`` on every interface for its predecessor in a split:
    there only the worker the host's llama-server named, with the key it made, gets through.
    It keeps its ports across restarts: the host's llama-server (or its tunnel) points at them. ``netem`` (rtt ms,
    MB/s: ``MESH_LLM_NETEM``, for benchmarks): the two listeners move to loopback ports behind relays on the public
    ones that delay each way by rtt/2 (``meshllm.delaytcp``), so the direct path and the peer links pay the round
    trip as the tunnels do; the server then sees every client at 127.0.0.1, so that holds for nodes of one machine."""

    def __init__(
        self, bins: Binaries, model: Path, log_dir: Path, device: str | None = None, keys_file: Path | None = None,
        tls_port: int | None = None, vouched: str | None = None, netem: tuple[float, float] | None = None,
    ) -> None:  # fmt: skip
        def argv(port: int) -> list[str]:
            return rpc_server_argv(bins, port, threads=default_threads(), gguf=model, device=device, vouched=vouched)

        def ready(child: Child, port: int) -> None:
            wait_tcp_ready(child, port, 30.0)

        self.tls_port: int | None = None
        self.peer_port: int | None = None
        env: dict[str, str] = {}
        if keys_file is not None and speaks_tls(bins.rpc_server):
            self.tls_port = tls_port or free_port(ANY_ADDR)
            env = {"GGML_RPC_TLS_LISTEN": host_port(ANY_ADDR, self.tls_port),
                   "GGML_RPC_TLS_SERVER_KEYS": str(keys_file)}
            if speaks_peers(bins.rpc_server):  # a fixed TLS port (--rpc-port P) fixes this one too: P+1
                self.peer_port = tls_port + 1 if tls_port else free_port(ANY_ADDR, avoid=[self.tls_port])
                env["GGML_RPC_PEER_LISTEN"] = host_port(ANY_ADDR, self.peer_port)
        taken = [p for p in (self.tls_port, self.peer_port) if p]
        self._delays: list[DelayProxy] = []
        if netem is not None:
            for name in ("GGML_RPC_TLS_LISTEN", "GGML_RPC_PEER_LISTEN"):
                if name in env:
                    public = int(env[name].rsplit(":", 1)[1])
                    inner = free_port(avoid=taken)
                    taken.append(inner)
                    env[name] = host_port(LOOPBACK, inner)
                    self._delays.append(DelayProxy(inner, netem[0], netem[1], ANY_ADDR, public))
        port = free_port(avoid=taken)  # none is bound yet: never the same one twice
        super().__init__(
            "rpc-server", bins.rpc_server, argv, ready, log_dir / "rpc-server.log", fixed_port=port, env=env
        )

    async def stop(self, grace_s: float = 10.0) -> None:
        await super().stop(grace_s)
        for d in self._delays:
            d.close()
