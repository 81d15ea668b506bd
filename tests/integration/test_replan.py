"""A living mesh: joins, a clean leave, a worker killed mid-stream, the host killed.

Five nodes of 0.5 GB each; the tiny model needs two (the host keeps the embedding, the output and the last
layers; one worker takes the rest). One scenario, in order, so the model loads stay few:
  1. two nodes join while requests run: no request fails, llama-server is not restarted (the plan holds);
  2. the worker leaves with SIGTERM while idle: the host re-plans onto a standby, no request fails afterwards;
  3. the new worker is killed -9 during a stream: the stream ends with an error event, the host re-plans, every
     node answers again, with the text of a fresh split of the same shape;
  4. the host is killed -9: another node hosts and the survivors answer.
And in one process, the host's side of a re-plan: plans in quick succession leave one llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from meshllm.llama.build import Binaries
from meshllm.llama.supervisor import ChildState, LocalServer, ServerConfig, Tuning
from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto
from meshllm.serve.split.hosting import Hosting

from .meshlab import NodeProc, children, wait_for
from .splitlab import PROMPT, stock_split_text

N = 32


def ask(port: int, n: int = N, timeout: float = 120) -> str:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "seed": 1, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


def plan_of(node: NodeProc) -> dict[str, object]:
    p = node.status().get("plan")
    return p if isinstance(p, dict) else {}


def main_plans(nodes: list[NodeProc]) -> list[dict[str, object]]:
    """The plans of the nodes that follow the elected host's plan: a node in a split replica's plan (its host a
    replica: the nodes the elected plan leaves out serve one) follows another, and is left out here."""
    replicas = {r for n in nodes for m in n.status().get("models", []) for r in m.get("replicas", [])}  # type: ignore[attr-defined]
    return [p for n in nodes if (p := plan_of(n)).get("host") not in replicas]


def roles(nodes: list[NodeProc]) -> tuple[NodeProc, NodeProc]:
    """(host, worker) according to the plan every node agrees on."""
    by_id = {json.loads((n.state / "status.json").read_text())["node"]: n for n in nodes}
    p = main_plans(nodes)[0]
    assign = p["assignments"]  # type: ignore[index]
    return by_id[assign[-1]["node"]], by_id[assign[0]["node"]]  # type: ignore[index]


def serving(nodes: list[NodeProc]) -> bool:
    for n in nodes:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{n.port}/health", timeout=5) as r:
                if r.status != 200:
                    return False
        except OSError:
            return False
    return True


def health_of(port: int) -> tuple[int, str]:
    """A node's /health: (status, body), whether it serves or not."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def describe(nodes: list[NodeProc]) -> str:
    return "; ".join(f"{n.state.name}: {json.dumps(plan_of(n))[:300]}" for n in nodes)


def agreed(nodes: list[NodeProc]) -> bool:
    main = main_plans(nodes)
    plans = {json.dumps(p, sort_keys=True) for p in main}
    return len(plans) == 1 and bool(main[0].get("assignments"))


def until_answered(nodes: list[NodeProc], t0: float, limit: float) -> float:
    """Seconds from t0 until every node has answered a request."""
    pending = list(nodes)
    while pending:
        n = pending[0]
        try:
            ask(n.port, 4, timeout=60)
            pending.pop(0)
        except (urllib.error.HTTPError, OSError):
            assert time.monotonic() - t0 < limit, f"{n.state.name} still not answering after {limit:.0f} s"
            time.sleep(0.25)
    return time.monotonic() - t0


def test_joins_leaves_and_deaths(tmp_path: Path, tiny_model: Path, stock_bins: Binaries) -> None:
    args = ("--max-vram", "0.446", "--ctx-size", "1024")
    a = NodeProc(tmp_path, "a", tiny_model, *args)
    nodes = [a]
    lite: NodeProc | None = None
    try:
        wait_for(lambda: (a.state / "token").exists(), 30, "token")
        token = (a.state / "token").read_text().strip()
        for name in "bc":
            nodes.append(NodeProc(tmp_path, name, tiny_model, *args, "--join", token))
        lite = NodeProc(tmp_path, "l", None, "--join", token)  # a lite client: never in a plan, not in `nodes`
        wait_for(lambda: serving(nodes) and agreed(nodes), 120, "three nodes serving")
        host, _ = roles(nodes)
        starts = host.status()["llama_starts"]

        # 1. two joins while requests run
        failures: list[str] = []
        done = threading.Event()

        def load(node: NodeProc) -> None:
            while not done.is_set():
                try:
                    ask(node.port, 8)
                except (urllib.error.HTTPError, OSError) as e:
                    failures.append(f"{node.state.name}: {e}")

        runners = [threading.Thread(target=load, args=(n,)) for n in nodes[:2]]
        for t in runners:
            t.start()
        for name in "de":
            nodes.append(NodeProc(tmp_path, name, tiny_model, *args, "--join", token))
        wait_for(lambda: all(len(n.status().get("peers", [])) == 6 for n in nodes), 60, "five nodes and l")  # type: ignore[arg-type]
        wait_for(lambda: len(plan_of(host).get("standby", [])) == 3, 30, "the newcomers on standby")  # type: ignore[arg-type]
        time.sleep(2)
        done.set()
        for t in runners:
            t.join(120)
        assert not failures, failures
        assert host.status()["llama_starts"] == starts, "a join that does not change the plan restarted llama-server"
        plan = plan_of(host)
        assert len(plan["assignments"]) == 2 and len(plan["standby"]) == 3, plan  # type: ignore[arg-type]

        # 2. the worker leaves cleanly while idle
        host, worker = roles(nodes)
        worker.stop(signal.SIGTERM)
        nodes.remove(worker)
        try:
            wait_for(lambda: serving(nodes) and agreed(nodes) and roles(nodes)[1] is not worker, 60, "a new worker")
        except AssertionError:
            raise AssertionError(f"no new worker: serving={serving(nodes)} {describe(nodes)}") from None
        for n in nodes:
            ask(n.port, 4)  # zero failed requests afterwards

        # 3. the new worker killed -9 during a stream
        host, worker = roles(nodes)
        via = next(n for n in nodes if n not in (host, worker))
        events: list[bytes] = []
        stamps: list[float] = []
        ended = threading.Event()

        def stream() -> None:
            body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
            req = urllib.request.Request(f"http://127.0.0.1:{via.port}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    for line in r:
                        if line.startswith(b"data: "):
                            events.append(line)
                            stamps.append(time.monotonic())
            except OSError as e:
                events.append(f"closed: {e}".encode())
            ended.set()

        th = threading.Thread(target=stream)
        th.start()
        wait_for(lambda: len(events) >= 5, 60, "the stream to start")
        doomed = children(worker.proc)
        t_kill = time.monotonic()
        worker.stop(signal.SIGKILL)
        nodes.remove(worker)
        assert ended.wait(90), "the stream hung after its worker died"
        # it goes on once the mesh has re-planned (it ended with an error event before): one stream
        assert events[-1] == b"data: [DONE]\n" and not any(b'"error"' in e for e in events), events[-3:]
        stall = max(y - x for x, y in itertools.pairwise(stamps))
        took = until_answered(nodes, t_kill, 90)
        print(f"\nworker kill -9 -> the stream's longest wait between events {stall:.1f} s; every node answering "
              f"{took:.1f} s after the kill (the stream ended first)")
        _, alive = psutil.wait_procs(doomed, timeout=10)
        assert not alive, "the killed node's rpc-server outlived it"
        wait_for(lambda: agreed(nodes), 30, "agreement on the new plan")
        host, worker = roles(nodes)
        text = ask(host.port, N)
        counts = [float(x["count"]) for x in plan_of(host)["assignments"]]  # type: ignore[index]
        assert stock_split_text(tmp_path / "ref", stock_bins, tiny_model, counts, N) == text
        for n in nodes:
            assert ask(n.port, N) == text

        # 4. the host killed -9
        assert lite is not None
        survivor = next(n for n in nodes if n is not host)
        said: dict[str, set[str]] = {"lite": set(), "survivor": set()}
        gap_over = threading.Event()

        def listen() -> None:  # what the lite client and a worker say while the mesh has no host
            while not gap_over.is_set():
                for who, n in (("lite", lite), ("survivor", survivor)):
                    with contextlib.suppress(OSError):
                        said[who].add(json.loads(health_of(n.port)[1]).get("reason") or "ok")
                time.sleep(0.2)

        listener = threading.Thread(target=listen)
        listener.start()
        counted = (lite.status().get("mesh_tokens") or {}).get("generated", 0)  # type: ignore[union-attr]
        assert counted > 0
        t_kill = time.monotonic()
        host.stop(signal.SIGKILL)
        nodes.remove(host)
        try:
            took = until_answered(nodes, t_kill, 120)
        finally:
            gap_over.set()
            listener.join()
        print(f"host kill -9 -> every survivor answering: {took:.1f} s")
        # one state and one reason on every node: a worker said the dead host "is loading the model"
        # while the lite client said "no host elected yet"; both now judge its silent record the same way
        # (a lite client may move on to the new host before it finds the old one silent: it has no election to settle)
        for who, reasons in said.items():
            assert not any("no host elected" in r for r in reasons), (who, said)
            about_dead = [r for r in reasons if host.short() in r]
            assert all(r.startswith(f"the host {host.short()} is unreachable") for r in about_dead), (who, said)
        # host changes are counted on a lite client too (it stayed 0 after two)
        with urllib.request.urlopen(f"http://127.0.0.1:{lite.port}/metrics", timeout=10) as r:
            elections = next(float(x.split()[-1]) for x in r.read().decode().splitlines()
                             if x.startswith("mesh_llm_elections_total"))  # fmt: skip
        assert elections >= 2, elections
        # a mesh-wide figure keeps what the dead host counted (it fell to the new host's count from zero)
        wait_for(lambda: (lite.status().get("mesh_tokens") or {}).get("host") != host.short(), 30, "the new host")  # type: ignore[union-attr]
        assert (lite.status().get("mesh_tokens") or {}).get("generated", 0) >= counted  # type: ignore[union-attr]
        # every survivor's plan names a host, and it is a survivor (roles() maps survivors' ids only: a plan that
        # still named the killed host would fail here with a KeyError, which is the failure we want)
        new_host, _ = roles(nodes)
        assert new_host in nodes and new_host is not host

        # 5. the last worker leaves: the host alone cannot hold the model, and every answer says so —
        # /health, a request, the host's own row — instead of "ok" over a model server that is gone
        host, worker = roles(nodes)
        worker.stop(signal.SIGTERM)
        nodes.remove(worker)
        wait_for(lambda: "waiting" in json.dumps(host.status().get("plan")), 60, "the host to wait for peers")

        def health() -> tuple[int, str]:
            return health_of(host.port)

        wait_for(lambda: health()[0] == 503, 30, "/health to say unavailable")
        assert "waiting for more peers" in health()[1], health()
        assert "then `mesh-llm --model MODEL --join TOKEN` there" in host.text()  # the next step
        with pytest.raises(urllib.error.HTTPError) as busy:
            ask(host.port, 4)
        assert busy.value.code == 503 and "waiting for more peers" in busy.value.read().decode()

        # the host's own row follows once its llama-server has stopped (the record changes a moment after the plan)
        def my_row() -> dict[str, object]:
            return next(p for p in host.status()["peers"] if p["path"] == "self")  # type: ignore[attr-defined, no-any-return]

        wait_for(lambda: my_row()["state"] != "serving", 15, f"the host's own row to stop saying serving: {my_row()}")

        # and a lite client gives the host's own reason, in /health and in a request's 503 (it said "the model server
        # failed: ServerDisconnectedError", then "no host elected yet")
        def lite_health() -> tuple[int, str]:
            assert lite is not None
            return health_of(lite.port)

        wait_for(lambda: "waiting for more peers" in lite_health()[1], 15, "the lite client to say why")
        assert lite_health()[0] == 503 and f"the host {host.short()} is waiting for more peers" in lite_health()[1]
        with pytest.raises(urllib.error.HTTPError) as busy:
            ask(lite.port, 4)
        assert busy.value.code == 503 and "waiting for more peers" in busy.value.read().decode()
        # its status (the console, `mesh-llm status`) says the same as its /health: one source
        wait_for(lambda: "waiting for more peers" in str(lite.status().get("unavailable")), 10, "l's status")
    finally:
        if lite is not None:
            lite.stop()
        for n in nodes:
            n.stop()


async def test_plans_in_quick_succession_leave_one_llama_server(
    tmp_path: Path, tiny_model: Path, patched_bins: Binaries
) -> None:
    """Two plans one after another, before the first restart has stopped the llama-server it replaces: before, each
    restart started its own and the first one's was left running, unsupervised (a llama-server holding a worker's
    rpc-server). Now the old llama-server gets no request from the moment a plan replaces it, a restart waits for the
    one before it, and a node that stops during a restart leaves nothing running."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    net = MeshNet(crypto.new_key(), None, state, bind=("127.0.0.1", 0))
    await net.start()
    h = Hosting(net, patched_bins, state, Tuning(), None, 8, on_listeners=lambda: None, elected=lambda: None)

    def cfg(ctx: int) -> ServerConfig:
        return ServerConfig(model=tiny_model, alias="tiny", ctx_size=ctx, threads=1)

    def servers() -> list[psutil.Process]:
        return [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"]

    async def serving() -> LocalServer:
        for _ in range(600):
            if h.server is not None and h.server.state == ChildState.SERVING:
                return h.server
            await asyncio.sleep(0.1)
        raise AssertionError("llama-server did not serve")

    try:
        h.replace_server(cfg(256), {})
        first = await serving()
        assert first.child is not None and len(servers()) == 1
        old = psutil.Process(first.child.pid)
        h.replace_server(cfg(512), {})
        assert h.server is None  # no request goes to the llama-server being replaced
        h.replace_server(cfg(1024), {})
        assert h._reconfig_task is not None
        await h._reconfig_task
        assert not old.is_running(), "the next llama-server started before the one it replaces had stopped"
        last = await serving()
        pids = [p.pid for p in servers()]
        assert last.cfg.ctx_size == 1024 and last.child is not None and pids == [last.child.pid], pids
        assert h.generations == 2  # the plan in between was never started
        h.replace_server(cfg(256), {})
        await h.stop()  # while that restart is under way
        await asyncio.sleep(0.5)
        assert servers() == [], [p.cmdline() for p in servers()]
    finally:
        await h.stop()
        await net.stop(leave=False)
