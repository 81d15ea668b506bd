"""A member restarted with its plain start command (no --join) rejoins the members it last knew, at
once: a worker, a lite client and the founder (on its old UDP port, so the invite tokens minted before still work).
Before, each elected itself host of a one-node mesh and waited for ever."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

from tests.integration.meshlab import NodeProc, split_pair, wait_for

REJOIN_S = 10.0


def _sees(n: NodeProc, *others: NodeProc) -> bool:
    try:
        return {o.short() for o in others} <= n.peers()
    except OSError:  # a node that has not written its key yet
        return False


def _ask(n: NodeProc) -> int:
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    url = f"http://127.0.0.1:{n.port}/v1/completions"
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except OSError:
        return 0


def _rpc_path(host: NodeProc, worker: NodeProc) -> str:
    """How the host's llama-server reaches ``worker`` now (its status; "" when it is not in the running split)."""
    me = json.loads((worker.state / "status.json").read_text())["node"]
    return str(next((p.get("rpc_path") for p in host.status()["peers"] if p["node"] == me), "") or "")  # type: ignore[attr-defined]


def _named(n: NodeProc) -> set[str]:
    """The short ids of the members the node's saved invite token names, the issuer's included."""
    from meshllm.proto import crypto
    from meshllm.proto import token as tok

    return {crypto.short(m) for m, _ in tok.parse((n.state / "token").read_text()).members()}


def _udp(n: NodeProc) -> list[str]:
    return list(json.loads((n.state / "node.json").read_text())["addrs"])


def test_a_restarted_worker_client_and_founder_rejoin_with_their_plain_command(tmp_path: Path,
                                                                               tiny_model: Path) -> None:  # fmt: skip
    nodes: list[NodeProc] = []
    try:
        a, b = split_pair(tmp_path, tiny_model, nodes)
        token = (a.state / "token").read_text().strip()
        c = NodeProc(tmp_path, "c", None, "--join", token)
        nodes.append(c)
        wait_for(lambda: _sees(a, b, c) and _sees(c, a, b) and _ask(c) == 200, 120, "the lite client to be served")
        worker_args = ("--max-vram", "0.3", "--ctx-size", "1024")  # b's start command, without --join

        # the worker, killed -9 (no goodbye) and started again at once: back before the mesh declares it dead
        assert _rpc_path(a, b).startswith("direct "), _rpc_path(a, b)
        b.stop(signal.SIGKILL)
        (b.state / "status.json").unlink()  # what the killed node last wrote: the restarted one writes its own
        b = NodeProc(tmp_path, "b", tiny_model, *worker_args, port=b.port)
        nodes.append(b)
        took = wait_for(lambda: _sees(b, a) and _sees(a, b), 30, "the worker to rejoin")
        assert took <= REJOIN_S, f"the worker rejoined in {took:.1f} s"
        # the line follows the dial's answer, which may come a moment after a's own connection to b (CI saw it)
        wait_for(lambda: "rejoined the mesh via" in b.text(), 10, "b's rejoin line")
        assert "new mesh" not in b.text(), b.text()
        # the host reaches it directly again (its rpc-server listens on a new port): it stayed on the
        # tunnel, the direct path blamed for a peer that had died
        wait_for(lambda: _ask(c) == 200 and _rpc_path(a, b).startswith("direct "), 120,
                 "the split to serve over the direct path again")  # fmt: skip

        # the lite client: `mesh-llm --client` with its state dir, no token
        c.stop()
        c = NodeProc(tmp_path, "c", None, port=c.port)
        nodes.append(c)
        took = wait_for(lambda: _sees(c, a), 30, "the lite client to rejoin")
        assert took <= REJOIN_S, f"the lite client rejoined in {took:.1f} s"
        wait_for(lambda: _ask(c) == 200, 120, "the restarted lite client to be served")

        # the founder, on the UDP port of its last run
        udp = _udp(a)
        a.stop()
        t0 = time.monotonic()
        a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024", port=a.port)
        nodes.append(a)
        wait_for(lambda: _sees(a, b) and _sees(b, a), 30, "the founder to rejoin")
        assert time.monotonic() - t0 <= REJOIN_S, f"the founder rejoined in {time.monotonic() - t0:.1f} s"
        assert _udp(a) == udp  # the same port: tokens minted before still name it
        wait_for(lambda: _ask(c) == 200, 120, "the mesh to serve again after the founder's restart")
        # a token minted before the founder's restart still admits a new member
        d = NodeProc(tmp_path, "d", None, "--join", token)
        nodes.append(d)
        wait_for(lambda: _sees(d, a), 30, "a new member through the old token")
        # the invite token the founder keeps names the other members too: with the founder away, a
        # joiner gets in through one of them
        wait_for(lambda: b.short() in _named(a), 15, "the founder's token to name the worker")
        fresh = (a.state / "token").read_text().strip()
        a.stop()
        e = NodeProc(tmp_path, "e", None, "--join", fresh)
        nodes.append(e)
        wait_for(lambda: _sees(e, b), 30, "a joiner through another member the token names")
        assert f"via {b.short()} (the token's issuer {a.short()} did not answer first)" in e.text(), e.text()
    finally:
        for n in nodes:
            n.stop()


def test_a_restart_with_no_member_answering_says_so_in_one_line(tmp_path: Path, tiny_model: Path) -> None:
    nodes: list[NodeProc] = []
    try:
        a, b = split_pair(tmp_path, tiny_model, nodes)
        b.stop()
        a.stop()
        lone = NodeProc(tmp_path, "b", tiny_model, "--max-vram", "0.3", "--ctx-size", "1024")
        nodes.append(lone)
        wait_for(lambda: "members this node knew answered" in lone.text(), 30, "the line")
        line = next(x for x in lone.text().splitlines() if "members this node knew answered" in x)
        assert "none of the 1 members" in line and "--join TOKEN" in line, line
        # it keeps dialling: the founder comes back (knowing nobody, so only the lone node's dialling can find it)
        # and they are one mesh again
        (a.state / "members.json").unlink()
        a2 = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024")
        nodes.append(a2)
        wait_for(lambda: _sees(lone, a2) and _sees(a2, lone), 30, "the two to find each other")
    finally:
        for n in nodes:
            n.stop()
