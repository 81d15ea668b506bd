"""Starting, watching and stopping the llama.cpp processes we own.

Every child runs in its own session (process group) with its output in a log file. We stop children only
through the process group we created — never by name — so other llama.cpp processes on the machine are
safe. Both servers bind 127.0.0.1 only: anyone whose bytes reach rpc-server owns the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import mmap
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshllm import sockets
from meshllm.errors import MeshError, UserError
from meshllm.llama.build import Binaries
from meshllm.llama.chat import ChatDefault

LOOPBACK = "127.0.0.1"
ANY_ADDR = "::"  # every interface, IPv4 and IPv6 (sockets.py): only the TLS-protected RPC listeners bind it


class ChildFailed(MeshError):
    """A child process exited or did not become ready in time."""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the thread that started us dies (Linux), so a crashed or killed
    mesh-llm leaves no llama.cpp behind. SIGKILL, not SIGTERM: llama-server sometimes hangs in its SIGTERM cleanup
    when it arrives just after start-up (seen here: "cleaning up before exit..." and no exit), and with the parent
    gone nobody would escalate. A clean mesh-llm shutdown still stops children with SIGTERM first (Child.stop).
    Elsewhere the supervisor's own shutdown path stops children."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


PICK_FROM = 20000  # free_port picks from here to the start of the kernel's ephemeral range


def _ephemeral_start() -> int:
    """The first port of the range the kernel hands out for outgoing connections and binds to port 0 (Linux);
    0 where that is not known."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = LOOPBACK, avoid: Collection[int] = ()) -> int:
    """A TCP port that was free a moment ago and is none of ``avoid`` (ports picked for a child that has not bound
    them yet). The child binds it later, so it is picked below the kernel's ephemeral range where that leaves room: a
    port the kernel hands to an outgoing connection, or to a bind to port 0, in the meantime is never this one (a
    CI run lost a node's API port that way). Elsewhere the kernel picks; a rare race is reported as a start failure."""
    top = _ephemeral_start()
    for _ in range(64 if top - PICK_FROM >= 1024 else 0):
        port = random.randrange(PICK_FROM, top)
        if port in avoid:
            continue
        try:
            sockets.bound(host, port, socket.SOCK_STREAM).close()
        except OSError:
            continue  # in use
        return port
    while True:
        with sockets.bound(host, 0, socket.SOCK_STREAM) as s:
            got: int = s.getsockname()[1]
        if got not in avoid:
            return got


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """Whether something listens on ``port`` (connections of a process just stopped, in TIME-WAIT, do not count:
    our servers bind with SO_REUSEADDR, and so does this check)."""
    try:
        sockets.bound(host, port, socket.SOCK_STREAM).close()
    except OSError:
        return True
    return False


def udp_free(host: str, port: int) -> bool:
    """Whether a UDP port can be bound now (0: no port to try)."""
    if not port:
        return False
    try:
        sockets.bound(host, port, socket.SOCK_DGRAM).close()
    except OSError:
        return False
    return True


def describe_exit(returncode: int | None) -> str:
    """'SIGSEGV' for a death by signal (Popen's negative return code), 'exit code 1' otherwise."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


AMX_MARKER = b"AMX is not ready to be used!"  # a string compiled into ggml only together with its AMX kernels


TLS_MARKER = b"GGML_RPC_TLS_LISTEN"  # the variable patch 0005's rpc-server reads: only TLS builds carry it
PEER_MARKER = b"GGML_RPC_PEER_LISTEN"  # patch 0011's (worker to worker): builds from before it lack it


def _binary_has(binary: Path, marker: bytes) -> bool:
    try:
        with binary.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(marker) >= 0
    except (OSError, ValueError):
        return False


@functools.cache
def speaks_tls(rpc_server: Path) -> bool:
    """Whether this rpc-server can open the direct RPC listener (TLS 1.3 with pre-shared keys; patch 0005). Read
    once per binary (a build's path names its inputs)."""
    return _binary_has(rpc_server, TLS_MARKER)


def speaks_peers(rpc_server: Path) -> bool:
    """Whether this rpc-server can open a listener for its predecessor in a split (worker to worker; patch 0011)."""
    return _binary_has(rpc_server, PEER_MARKER)


def uses_amx(binary: Path, cpu_flags: frozenset[str]) -> bool:
    """Whether ``binary`` carries ggml's AMX kernels and this CPU would run them."""
    if not {"amx_tile", "amx_int8"} <= cpu_flags:
        return False
    return _binary_has(binary, AMX_MARKER)


def explain_crash(returncode: int | None, log_text: str, amx: bool = False) -> str:
    """The likely cause of a llama.cpp server's death and its fix, in one line, from its exit, its log and
    whether it runs ggml's AMX kernels on an AMX CPU (:func:`uses_amx`)."""
    rc = returncode or 0
    log_lower = log_text.lower()
    if amx and rc in (-signal.SIGILL, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT):
        return (
            "llama.cpp's AMX kernels crash on this CPU (upstream llama.cpp issue 20824); fix: rebuild with "
            "`mesh-llm build` (its builds leave AMX out), or build yours with -DGGML_NATIVE=OFF and no -DGGML_AMX_*"
        )
    if rc == -signal.SIGILL:
        return (
            "the binaries use CPU instructions this CPU lacks (built on another machine?); fix: run `mesh-llm build` "
            "on this machine, or use a bundle (`mesh-llm bundle` makes portable binaries)"
        )
    if rc == -signal.SIGKILL:
        return "it was killed, most likely out of memory; fix: a smaller model, a smaller --ctx-size or --max-vram"
    if "out of memory" in log_lower or "failed to allocate" in log_lower or "unable to allocate" in log_lower:
        return "it ran out of memory; fix: a smaller model, a smaller --ctx-size, or --max-vram to offer less"
    if "failed to load model" in log_lower or "error loading model" in log_lower:
        return "it could not load the model (a damaged or unsupported GGUF?); fix: check the file, or download it again"
    if "address already in use" in log_lower or "couldn't bind" in log_lower:
        return "its port was taken by another process; it gets a new one at the next start"
    if rc < 0:
        return "it crashed; fix: see its log, and report it with the log if it persists"
    return "it exited on its own; see its log"


# ------------------------------------------------------------------------------------------ command lines


def rpc_server_argv(
    bins: Binaries, port: int, *, threads: int | None = None, gguf: Path | None = None, device: str | None = None,
    vouched: str | None = None,
) -> list[str]:
    """ggml-rpc-server on loopback. ``gguf`` (patched binaries only) lets it load weights from its own file;
    ``vouched``: that file is a partial copy, and this the model fingerprint we checked for it (patch 0010)."""
    argv = [str(bins.rpc_server), "--host", LOOPBACK, "--port", str(port)]
    if threads:
        argv += ["--threads", str(threads)]
    if device:
        argv += ["--device", device]
    if gguf is not None:
        argv += ["--gguf", str(gguf)]
        if vouched is not None:
            argv += ["--gguf-fingerprint", vouched]
    return argv


# the ones a user may name with --chat-template (llama.cpp's list, src/llama-chat.cpp, b11312)
BUILTIN_TEMPLATES = frozenset({
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
    "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr", "monarch", "gemma",
    "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2", "deepseek3", "command-r", "llama3",
    "chatglm3", "chatglm4", "glmedge", "minicpm", "exaone3", "exaone4", "granite", "granite-4.0", "gigachat", "megrez",
    "yandex", "bailing", "llama4", "smolvlm", "gpt-oss", "kimi-k2", "seed_oss",
})  # fmt: skip


@dataclass(frozen=True)
class Tuning:
    """llama-server's serving options a user sets through mesh-llm (checked when parsed, applied by the host)."""

    cache_type: str = "f16"  # K and V cache type: f16, q8_0, q4_0 (the planner charges its bytes)
    flash_attn: str = "auto"  # on, off, auto (llama.cpp uses it where the backend has it)
    batch: int | None = None  # --batch-size (logical)
    ubatch: int | None = None  # --ubatch-size (physical)
    chat_template: str | None = None  # a built-in template's name
    chat_template_file: Path | None = None  # a Jinja template file
    jinja: bool | None = None  # None: llama-server's default (on)
    rope_scaling: str | None = None  # none, linear, yarn
    rope_freq_scale: float | None = None
    reasoning_format: str | None = None  # none, deepseek, deepseek-legacy, auto
    sampling: tuple[tuple[str, str], ...] = ()  # defaults for requests that do not say: ("--temp", "0.7"), ...

    def default_chat(self, chat: ChatDefault | None) -> ChatDefault | None:
        """``chat`` when its template of ours is what llama-server gets: the user named none, and Jinja is on."""
        named = self.chat_template or self.chat_template_file
        return chat if chat and chat.file and not named and self.jinja is not False else None

    def argv(self, chat: ChatDefault | None = None) -> list[str]:
        """Its flags; ``chat``: the template for a model without one of its own (used unless the user chose)."""
        out = ["--flash-attn", self.flash_attn]
        if self.cache_type != "f16":
            out += ["--cache-type-k", self.cache_type, "--cache-type-v", self.cache_type]
        if self.batch:
            out += ["--batch-size", str(self.batch)]
        if self.ubatch:
            out += ["--ubatch-size", str(self.ubatch)]
        jinja = self.jinja
        builtin = chat.builtin if chat and not self.jinja else None
        ours = self.default_chat(chat)
        if self.chat_template_file is not None:
            out += ["--chat-template-file", str(self.chat_template_file)]
        elif self.chat_template or builtin:
            out += ["--chat-template", self.chat_template or builtin or ""]
            jinja = False if jinja is None else jinja  # with Jinja on, llama-server reads a name as a template's text
        elif ours is not None and ours.file is not None:
            out += ["--chat-template-file", str(ours.file)]
        if jinja is not None:
            out += ["--jinja" if jinja else "--no-jinja"]
        if self.rope_scaling:
            out += ["--rope-scaling", self.rope_scaling]
        if self.rope_freq_scale:
            out += ["--rope-freq-scale", f"{self.rope_freq_scale:g}"]
        if self.reasoning_format:
            out += ["--reasoning-format", self.reasoning_format]
        for flag, value in self.sampling:
            out += [flag, value]
        return out


def llama_server_argv(
    bins: Binaries,
    model: Path,
    port: int,
    *,
    ctx_size: int = 4096,
    parallel: int = 1,
    tuning: Tuning = Tuning(),
    chat: ChatDefault | None = None,
    threads: int | None = None,
    alias: str | None = None,
    rpc: Sequence[str] = (),
    n_gpu_layers: int | None = None,
    tensor_split: Sequence[float] = (),
    device: str | None = None,
    draft: Path | None = None,
    draft_max: int = 8,
    draft_device: str | None = None,
    embeddings: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """The one place that builds llama-server's command line. ``ctx_size``: each slot's context (llama-server's
    --ctx-size is all slots' together); continuous batching on, each slot its own KV cells (not unified: a slot's
    context is what the planner charged). ``embeddings``: an embedding model's, that many tokens a batch (a
    sequence's vectors are pooled in one batch, so an input may be as long as a batch: its slot's context)."""
    argv = [
        str(bins.llama_server), "--host", LOOPBACK, "--port", str(port), "--model", str(model),
        "--ctx-size", str(ctx_size * parallel), "--no-webui", "--parallel", str(parallel), "--cont-batching",
        "--no-kv-unified", "--metrics", *tuning.argv(chat),
    ]  # fmt: skip
    if embeddings:
        argv += ["--embeddings", "--batch-size", str(embeddings), "--ubatch-size", str(embeddings)]
    if threads:
        argv += ["--threads", str(threads)]
    if alias:
        argv += ["--alias", alias]
    if rpc:
        argv += ["--rpc", ",".join(rpc)]
    if n_gpu_layers is not None:
        argv += ["--n-gpu-layers", str(n_gpu_layers)]
    if tensor_split:
        argv += ["--tensor-split", ",".join(f"{x:g}" for x in tensor_split)]
    if device:
        argv += ["--device", device]
    if draft is not None:
        # the draft runs on the host's own device ("none": this process's CPU), never on an RPC worker,
        # whatever the main model's device list says
        argv += ["--spec-draft-model", str(draft), "--spec-draft-n-max", str(draft_max),
                 "--spec-draft-device", draft_device or "none"]  # fmt: skip
        if not draft_device or draft_device == "none":
            argv += ["--spec-draft-ngl", "0"]
    argv += list(extra)
    return argv


def device_listing(bins: Binaries, timeout: float = 60.0) -> str:
    """What ``llama-server --list-devices`` prints: the accelerators this build sees, with total and free memory
    (parse it with ``proto.capacity.parse_devices``). Empty when it cannot run."""
    try:
        r = subprocess.run(
            [str(bins.llama_server), "--list-devices"], capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout


# ------------------------------------------------------------------------------------------ children


@dataclass
class Child:
    """A process we started, in its own process group, logging to ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @classmethod
    def start(cls, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> Child:
        exe = Path(argv[0])
        if not exe.is_file():
            raise UserError(f"{name}: binary {exe} not found (run `mesh-llm build`)")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            log.write(f"\n$ {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop() signals exactly what we started
                preexec_fn=_die_with_parent,
            )
        return cls(name=name, argv=list(argv), log_path=log_path, proc=proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM the child's process group, then SIGKILL after ``timeout``. Returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        else:
            # the leader is gone; make sure nothing it forked survives in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def http_get_json(url: str, timeout: float = 2.0) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read() or b"null")
        except ValueError:
            body = None
        return e.code, body


def wait_http_ready(child: Child, url: str, timeout: float = 120.0) -> None:
    """Poll ``url`` until it answers 200; fail at once if the child exits."""
    deadline = time.monotonic() + timeout
    while True:
        if not child.alive():
            raise ChildFailed(f"{child.name} exited with {child.proc.returncode}: {child.log_tail(3)}")
        try:
            status, _ = http_get_json(url, timeout=2.0)
            if status == 200:
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ChildFailed(f"{child.name} not ready at {url} after {timeout:.0f} s: {child.log_tail(3)}")
        time.sleep(0.1)


def wait_tcp_ready(child: Child, port: int, timeout: float = 30.0, host: str = LOOPBACK) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not child.alive():
            raise ChildFailed(f"{child.name} exited with {child.proc.returncode}: {child.log_tail(3)}")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ChildFailed(f"{child.name} not listening on {host}:{port} after {timeout:.0f} s")
        time.sleep(0.05)
